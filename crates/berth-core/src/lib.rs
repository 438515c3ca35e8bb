//! berth-core: the admission engine, a deterministic state machine with no I/O.
//!
//! Time (monotonic milliseconds), memory samples and every request come in as values
//! through [`Engine::apply`]; decisions come out as [`Event`]s and a reply. The engine
//! never reads a clock, touches a file, spawns a thread or draws a random number, so the
//! same inputs always give the same outputs. That is what lets the scenario tests, the
//! property tests and the simulator check it exhaustively.

mod command;
mod config;
mod engine;
mod queue;
pub mod scopes;
pub mod threads;
mod types;
mod units;
pub mod validate;

pub use command::{Command, Error, Event, HostSample, Output, PressureKind};
pub use config::{
    Config, GIB, MIB, PRESSURE_BACKGROUND_MAX_BP, PRESSURE_BP_MAX, PRESSURE_FOREGROUND_MAX_BP,
    SLOTS_MAX_LIMIT, STABILIZE_SAMPLES_MAX, WINDOW_MAX,
};
pub use engine::{
    Engine, FleetNeeds, ProjectFigures, ResourceFigures, RestoredRun, Snapshot, FLEET_KEYS_MAX,
    FLEET_SINGLETON_PREFIX, PORTS_MAX, SINGLETONS_MAX,
};
pub use types::*;
