//! Long-lived background tasks that outlive their own panics. A task that panics (a bug)
//! would otherwise end silently — a pusher that never pushes again, retention that
//! stops — while the gateway looks healthy. [`keep_running`] says so loudly (an ERROR
//! log naming the task, `outbox_task_panics_total{task}`, and a hook for showing it
//! where the task's state is shown) and starts the task anew after a growing delay, so
//! a panic on every run does not spin.

use std::{any::Any, future::Future, panic::AssertUnwindSafe, time::Duration};

use futures_util::FutureExt;
use tokio::time::Instant;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::metrics;

/// The tasks of one subsystem: spawned on the process's one tracker, and counted on the
/// subsystem's own as well, so that its shutdown can wait for them alone.
#[derive(Debug, Clone)]
pub struct SubsystemTasks {
    process: TaskTracker,
    own: TaskTracker,
}

impl SubsystemTasks {
    pub fn on(process: &TaskTracker) -> Self {
        SubsystemTasks {
            process: process.clone(),
            own: TaskTracker::new(),
        }
    }

    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.process.spawn(self.own.track_future(task));
    }

    /// Waits until every task of the subsystem has ended; none may be spawned after.
    pub async fn close_and_wait(&self) {
        self.own.close();
        self.own.wait().await;
    }
}

/// Delays before restarting a task after a panic: the first, doubling up to the last.
#[derive(Debug, Clone, Copy)]
pub struct RestartDelays {
    pub first: Duration,
    pub max: Duration,
}

impl Default for RestartDelays {
    /// One second, doubling to a minute.
    fn default() -> Self {
        RestartDelays {
            first: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

/// A background task: what it is (`task`, a bounded metric label such as "pusher") and
/// which one (`name`, such as the subscription; empty for a task of its own kind).
#[derive(Debug, Clone, Copy)]
pub struct TaskName<'a> {
    pub task: &'static str,
    pub name: &'a str,
}

impl TaskName<'static> {
    /// The one task of its kind.
    pub fn single(task: &'static str) -> Self {
        TaskName { task, name: "" }
    }
}

/// Runs the task `start` makes until it returns, starting it anew after each panic (see
/// the module doc); `on_panic` gets the panic's message. Returns when the task returns,
/// or when `stop` is cancelled while waiting to restart. The task runs inside this
/// future, so aborting or dropping it ends the task too.
pub async fn keep_running<F, Fut>(
    what: TaskName<'_>,
    delays: RestartDelays,
    stop: CancellationToken,
    mut start: F,
    mut on_panic: impl FnMut(&str),
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut delay = delays.first;
    loop {
        let started = Instant::now();
        // Nothing the task shared is used after its panic but what `start` makes anew.
        let Err(panic) = AssertUnwindSafe(start()).catch_unwind().await else {
            return;
        };
        // A task that ran well for a while before failing starts over at the first delay.
        if started.elapsed() >= delays.max {
            delay = delays.first;
        }
        let message = panic_message(panic.as_ref());
        tracing::error!(
            task = what.task,
            name = what.name,
            panic = %message,
            restart_in = ?delay,
            "background task panicked; restarting it"
        );
        metrics::task_panicked(what.task);
        on_panic(&message);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(delays.max);
    }
}

/// The text a panic was raised with.
pub fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[tokio::test]
    async fn a_panicking_task_is_restarted_with_growing_delays_until_it_returns() {
        let delays = RestartDelays {
            first: Duration::from_millis(50),
            max: Duration::from_millis(150),
        };
        let starts = Arc::new(Mutex::new(Vec::new()));
        let panics = Arc::new(Mutex::new(Vec::new()));
        let started = Instant::now();
        keep_running(
            TaskName {
                task: "test",
                name: "one",
            },
            delays,
            CancellationToken::new(),
            || {
                let starts = starts.clone();
                async move {
                    let run = {
                        let mut starts = starts.lock().unwrap();
                        starts.push(started.elapsed());
                        starts.len()
                    };
                    tokio::task::yield_now().await;
                    if run <= 4 {
                        panic!("run {run} failed");
                    }
                }
            },
            |message| panics.lock().unwrap().push(message.to_owned()),
        )
        .await;
        let starts = starts.lock().unwrap().clone();
        assert_eq!(starts.len(), 5, "four panics, then a run that returned");
        assert_eq!(
            *panics.lock().unwrap(),
            [
                "run 1 failed",
                "run 2 failed",
                "run 3 failed",
                "run 4 failed"
            ]
        );
        // 50 ms, 100 ms, then capped at 150 ms.
        let gaps: Vec<Duration> = starts.windows(2).map(|pair| pair[1] - pair[0]).collect();
        for (gap, least) in gaps.iter().zip([50, 100, 150, 150]) {
            assert!(*gap >= Duration::from_millis(least), "{gaps:?}");
        }
    }

    #[tokio::test]
    async fn stopping_ends_the_wait_for_a_restart() {
        let stop = CancellationToken::new();
        let runs = Arc::new(Mutex::new(0));
        let waiting = tokio::spawn(keep_running(
            TaskName::single("test"),
            RestartDelays {
                first: Duration::from_secs(3600),
                max: Duration::from_secs(3600),
            },
            stop.clone(),
            {
                let runs = runs.clone();
                move || {
                    *runs.lock().unwrap() += 1;
                    async { panic!("always") }
                }
            },
            |_| {},
        ));
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("stops at once")
            .unwrap();
        assert_eq!(*runs.lock().unwrap(), 1);
    }
}
