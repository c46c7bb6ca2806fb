//! What the tests that write files share: a fresh path in the system temp dir, removed after a
//! passing test.

#[path = "../../../test-support/scratch.rs"]
mod scratch;
pub use scratch::Scratch;

impl Scratch {
    /// A fresh, empty directory `brigade-models-{name}-{pid}`.
    pub fn dir(name: &str) -> Scratch {
        Scratch::empty_dir(std::env::temp_dir().join(format!("brigade-models-{name}-{}", std::process::id())))
    }

    /// The path of a file `brigade-models-{pid}-{name}` (`name` keeps its extension last),
    /// not there yet.
    pub fn file(name: &str) -> Scratch {
        Scratch::absent_file(std::env::temp_dir().join(format!("brigade-models-{}-{name}", std::process::id())))
    }
}
