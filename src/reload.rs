//! Settings read from files and re-read when the files change: the TLS
//! certificate and key that cert-manager rotates, the client CA, the access
//! policy. The files are read again every interval and compared with what was
//! loaded; the newest contents that load are used, and contents that fail to
//! load are logged while the previous value stays in force.
//!
//! Reading the whole (small) files instead of watching timestamps follows
//! Kubernetes' Secret and ConfigMap updates, which swap a symlink.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

type Load<T> = Box<dyn Fn(&[Vec<u8>]) -> anyhow::Result<T> + Send + Sync>;

/// A value built from the contents of some files, rebuilt when they change.
pub struct Reloading<T> {
    /// What the files hold, for the log: "TLS certificate", "policy".
    what: &'static str,
    /// Each file with the setting that names it, for errors.
    files: Vec<(&'static str, PathBuf)>,
    load: Load<T>,
    state: RwLock<State<T>>,
}

struct State<T> {
    contents: Vec<Vec<u8>>,
    value: Arc<T>,
}

impl<T: Send + Sync + 'static> Reloading<T> {
    /// Reads and loads the files now; an error here stops the start. Each
    /// file comes with the setting that names it: a file that cannot be read
    /// is reported as `SETTING=path: cannot read: …`, and `load`'s errors
    /// should name the setting too.
    pub fn open(
        what: &'static str,
        files: Vec<(&'static str, PathBuf)>,
        load: impl Fn(&[Vec<u8>]) -> anyhow::Result<T> + Send + Sync + 'static,
    ) -> anyhow::Result<Arc<Self>> {
        let contents = read_all(&files)?;
        let value = load(&contents)?;
        Ok(Arc::new(Self {
            what,
            files,
            load: Box::new(load),
            state: RwLock::new(State {
                contents,
                value: Arc::new(value),
            }),
        }))
    }

    /// The value in force.
    pub fn current(&self) -> Arc<T> {
        self.state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .value
            .clone()
    }

    /// Reads the files again and reloads when they changed. True when a new
    /// value is in force.
    pub fn check(&self) -> bool {
        let contents = match read_all(&self.files) {
            Ok(contents) => contents,
            Err(error) => {
                tracing::error!(
                    what = self.what,
                    error = format!("{error:#}"),
                    "cannot read the files; keeping the previous value"
                );
                return false;
            }
        };
        if self
            .state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contents
            == contents
        {
            return false;
        }
        match (self.load)(&contents) {
            Ok(value) => {
                *self.state.write().unwrap_or_else(|e| e.into_inner()) = State {
                    contents,
                    value: Arc::new(value),
                };
                tracing::info!(what = self.what, "reloaded");
                true
            }
            Err(error) => {
                tracing::error!(
                    what = self.what,
                    error = format!("{error:#}"),
                    "the files changed but do not load; keeping the previous value"
                );
                // Remember them, so the same broken contents are logged once.
                self.state
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .contents = contents;
                false
            }
        }
    }

    /// Checks the files every `interval` until cancelled.
    pub async fn watch(self: Arc<Self>, interval: Duration, cancel: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let this = self.clone();
            // File reads and certificate parsing are blocking work.
            let _ = tokio::task::spawn_blocking(move || this.check()).await;
        }
    }
}

fn read_all(files: &[(&'static str, PathBuf)]) -> anyhow::Result<Vec<Vec<u8>>> {
    files
        .iter()
        .map(|(setting, path)| {
            std::fs::read(path)
                .with_context(|| format!("{setting}={}: cannot read", path.display()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_number(contents: &[Vec<u8>]) -> anyhow::Result<u32> {
        Ok(std::str::from_utf8(&contents[0])?.trim().parse()?)
    }

    #[test]
    fn a_change_is_loaded_and_a_broken_one_keeps_the_previous_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "1").unwrap();
        let value =
            Reloading::open("number", vec![("NUMBER_FILE", path.clone())], parse_number).unwrap();
        assert_eq!(*value.current(), 1);
        assert!(!value.check());

        std::fs::write(&path, "2").unwrap();
        assert!(value.check());
        assert_eq!(*value.current(), 2);

        std::fs::write(&path, "two").unwrap();
        assert!(!value.check());
        assert_eq!(*value.current(), 2);

        std::fs::remove_file(&path).unwrap();
        assert!(!value.check());
        assert_eq!(*value.current(), 2);
    }

    #[test]
    fn files_that_do_not_load_or_cannot_be_read_at_start_are_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "x").unwrap();
        let error = Reloading::open("number", vec![("NUMBER_FILE", path.clone())], parse_number)
            .err()
            .unwrap();
        assert_eq!(format!("{error:#}"), "invalid digit found in string");
        std::fs::remove_file(&path).unwrap();
        let error = Reloading::open("number", vec![("NUMBER_FILE", path.clone())], parse_number)
            .err()
            .unwrap();
        assert_eq!(
            format!("{error:#}"),
            format!(
                "NUMBER_FILE={}: cannot read: No such file or directory (os error 2)",
                path.display()
            )
        );
    }
}
