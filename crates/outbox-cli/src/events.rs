//! `events`: look up one event and where it stands with each subscription.

use outbox_client::proto;

use crate::{Target, describe, render};

/// What `outbox-gateway events` does.
#[derive(Debug, clap::Subcommand)]
pub enum EventCommand {
    /// Show an event: its fields and payload, and on every subscription whether it is
    /// pending, in flight, awaiting retry, acked or dead.
    Get {
        /// The event's id (UUID).
        id: String,
        /// The source database holding it (default: the first that has it).
        #[arg(long, default_value = "")]
        source: String,
    },
}

pub(crate) async fn events(target: &Target, command: EventCommand) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    match command {
        EventCommand::Get { id, source } => {
            let deliveries = admin
                .get_event(proto::GetEventRequest { id, source })
                .await
                .map_err(describe)?
                .into_inner();
            target.print(render::event_deliveries(&deliveries), || {
                render::event_deliveries_text(&deliveries)
            });
        }
    }
    Ok(())
}
