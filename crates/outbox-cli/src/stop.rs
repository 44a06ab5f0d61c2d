//! How a command that runs until interrupted (`tail`, `stats --watch`) learns it should
//! stop: SIGINT (Ctrl-C) or SIGTERM, the signal service managers and `timeout(1)` send.

/// SIGINT (Ctrl-C) and SIGTERM, listened for from the moment they are installed.
pub(crate) struct StopSignals {
    #[cfg(unix)]
    signals: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl StopSignals {
    pub(crate) fn install() -> StopSignals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            StopSignals {
                signals: signal(SignalKind::interrupt())
                    .and_then(|interrupt| Ok((interrupt, signal(SignalKind::terminate())?)))
                    .ok(),
            }
        }
        #[cfg(not(unix))]
        StopSignals {}
    }

    /// Completes when one of them arrived (since `install`).
    pub(crate) async fn received(&mut self) {
        #[cfg(unix)]
        if let Some((interrupt, terminate)) = &mut self.signals {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}
