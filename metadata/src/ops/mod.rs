//! One module per namespace operation; each is a single transaction.

mod answered;
mod create;
pub mod fsck;
pub mod holders;
pub mod layout;

mod link;
mod lookup;
pub mod nodes;
mod remove;
mod rename;
mod setattr;
pub mod tier;
pub mod xattr;

pub use remove::Unlinked;
pub use setattr::AtimeRule;
