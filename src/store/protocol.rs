//! The phases as typed calls over any [`Store`]. [`Protocol`] holds the loaded scripts; each
//! script's call, encoding and reply decoding live in its codec under [`super::phase`], the only
//! Rust that knows a script's `KEYS`/`ARGV` layout. Replies are parsed there, once, into enums;
//! nothing above matches a script's text.

use super::scripts::Scripts;
use super::{Store, StoreError};

/// The protocol over a store.
#[derive(Debug)]
pub struct Protocol<S> {
    pub(super) store: S,
    pub(super) scripts: Scripts,
}

impl<S: Store> Protocol<S> {
    /// Loads every phase script into the store: a script the store cannot compile fails here.
    pub async fn new(store: S) -> Result<Self, StoreError> {
        let scripts = Scripts::new();
        for script in scripts.all() {
            store.load(script).await?;
        }
        Ok(Protocol { store, scripts })
    }

    /// The scripts it runs.
    pub fn scripts(&self) -> &Scripts {
        &self.scripts
    }

    /// The store the scripts run on (tests look at its keys directly).
    pub fn store(&self) -> &S {
        &self.store
    }
}
