//! The transaction-scoped advisory lock on a subscription that claims, settlements and
//! position changes take, so that which event goes out next is decided by one
//! transaction at a time.

use outbox_domain::SubscriptionId;
use sqlx::PgConnection;

use super::Result;

/// First key of the gateway's advisory locks; the second is the subscription id.
pub(super) const SUBSCRIPTION_LOCK_CLASS: i32 = 0x6f62_7801;

#[derive(Clone, Copy)]
pub(super) enum LockMode {
    Exclusive,
    Shared,
}

pub(super) async fn lock_subscription(
    connection: &mut PgConnection,
    subscription_id: SubscriptionId,
    mode: LockMode,
) -> Result<()> {
    let statement = match mode {
        LockMode::Exclusive => "SELECT pg_advisory_xact_lock($1, $2::int)",
        LockMode::Shared => "SELECT pg_advisory_xact_lock_shared($1, $2::int)",
    };
    sqlx::query(statement)
        .bind(SUBSCRIPTION_LOCK_CLASS)
        .bind(subscription_id.0)
        .execute(connection)
        .await?;
    Ok(())
}
