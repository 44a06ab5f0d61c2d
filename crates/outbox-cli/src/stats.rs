//! `stats`: delivery stats of every subscription, once or with `--watch`.

use std::time::Duration;

use outbox_client::proto;

use crate::{StopSignals, Target, describe, render};

pub(crate) async fn stats(
    target: &Target,
    subscription: String,
    watch: bool,
    interval: Duration,
) -> Result<(), String> {
    // Listening from the start and across refreshes: a signal that came while figures
    // were being fetched would otherwise be missed, and SIGTERM would kill the process.
    let mut stop = watch.then(StopSignals::install);
    let mut admin = target.connect(true).await?.admin();
    loop {
        let stats = admin
            .get_stats(proto::GetStatsRequest {
                subscription: subscription.clone(),
            })
            .await
            .map_err(describe)?
            .into_inner();
        target.print(render::stats(&stats), || {
            if watch {
                // Clear the screen and go home, like watch(1).
                print!("\x1b[2J\x1b[H");
            }
            render::stats_table(&stats);
        });
        let Some(stop) = stop.as_mut() else {
            return Ok(());
        };
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            () = stop.received() => return Ok(()),
        }
    }
}
