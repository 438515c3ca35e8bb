//! The engine's units, named once: time and fences are plain integers whose meaning
//! is in their name. A module of its own so that every other module can use them
//! without depending on the request and run types.

/// Monotonic milliseconds. The caller owns the clock; the engine only compares.
pub type TimeMs = u64;
/// A fencing token (L1). Strictly increasing per host, never reused.
pub type Fence = u64;
