//! `stats`: delivery stats of every subscription, once or with `--watch`.

use std::time::Duration;

use outbox_client::proto;

use crate::{Target, describe, render};

pub(crate) async fn stats(
    target: &Target,
    subscription: String,
    watch: bool,
    interval: Duration,
) -> Result<(), String> {
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
        if !watch {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}
