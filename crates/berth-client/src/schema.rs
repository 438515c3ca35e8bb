//! OpenAPI schemas for the types the wire borrows from berth-core (which knows nothing
//! of OpenAPI): each of its word enums is a string enum built from the enum's own
//! `ALL` table, so the document can never list a word the API does not accept.

use berth_core::{Class, ConcurrencyClass, KeyMode, Priority, RunState};
use utoipa::openapi::schema::{ObjectBuilder, Type};

/// A berth-core enum written as one of its words.
pub trait Words: 'static {
    fn all() -> Vec<&'static str>;
}

macro_rules! words_of {
    ($($t:ty),*) => {
        $(impl Words for $t {
            fn all() -> Vec<&'static str> {
                <$t>::ALL.iter().map(|w| w.as_str()).collect()
            }
        })*
    };
}

words_of!(Class, ConcurrencyClass, KeyMode, Priority, RunState);

/// The string enum of `T`'s words.
pub fn words<T: Words>() -> utoipa::openapi::Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(T::all()))
        .build()
}
