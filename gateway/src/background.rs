//! The work that outlives a request's connection, counted so that a
//! shutdown can wait for it.
//!
//! A guarded request's work runs in a task of its own from the Claim on
//! (see [`crate::flow`]), so a client that leaves does not stop it. Once its
//! connection is gone, hyper's graceful shutdown no longer sees it: without
//! this count, SIGTERM would end the process under a claimed request whose
//! upstream call, Complete or Release had not finished, and leave its key in
//! progress until the lease ran out, or its effect unstored. The server
//! waits for [`Background::idle`] after the connections have drained.
//!
//! (tokio-util's `TaskTracker` does this too; its `rt` feature would
//! change the build of every workspace member that shares tokio-util, for
//! twenty lines.)

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// A count of the background work running; clones share it.
#[derive(Clone, Default)]
pub struct Background(Arc<Count>);

#[derive(Default)]
struct Count {
    running: AtomicUsize,
    idle: Notify,
}

impl Background {
    /// Spawns `work` on the runtime, counted until it finishes.
    pub fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) -> JoinHandle<()> {
        tokio::spawn(self.track(work))
    }

    /// `work`, counted from this call (not from its first poll, so that
    /// work handed to a task is never missed) until it finishes or is
    /// dropped.
    pub fn track<F: Future>(&self, work: F) -> impl Future<Output = F::Output> + use<F> {
        self.0.running.fetch_add(1, Ordering::SeqCst);
        let running = Running(self.0.clone());
        async move {
            let _running = running;
            work.await
        }
    }

    /// How much work is running.
    pub fn running(&self) -> usize {
        self.0.running.load(Ordering::SeqCst)
    }

    /// Resolves once no work is running.
    pub async fn idle(&self) {
        loop {
            let notified = self.0.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so an end between the two wakes it.
            notified.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One unit of running work; its drop ends it.
struct Running(Arc<Count>);

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn idle_waits_for_every_piece_of_work_and_no_longer() {
        let background = Background::default();
        background.idle().await;
        let (first_done, first) = tokio::sync::oneshot::channel::<()>();
        let (second_done, second) = tokio::sync::oneshot::channel::<()>();
        background.spawn(async move {
            let _ = first.await;
        });
        // Counted as soon as it is handed over, before it runs.
        let unpolled = background.track(async move {
            let _ = second.await;
        });
        assert_eq!(background.running(), 2);
        let idle = background.clone();
        let idle = tokio::spawn(async move { idle.idle().await });
        first_done.send(()).unwrap();
        second_done.send(()).unwrap();
        assert!(
            tokio::time::timeout(Duration::from_secs(5), async {
                while background.running() != 1 {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .is_ok()
        );
        assert!(!idle.is_finished());
        unpolled.await;
        tokio::time::timeout(Duration::from_secs(5), idle)
            .await
            .expect("idle once the work is done")
            .unwrap();
        assert_eq!(background.running(), 0);
    }
}
