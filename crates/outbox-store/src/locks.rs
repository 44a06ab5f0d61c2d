//! The transaction-scoped advisory lock on a subscription that claims, settlements and
//! position changes take, so that which event goes out next is decided by one
//! transaction at a time.

use outbox_domain::SubscriptionId;
use sqlx::{AssertSqlSafe, PgConnection, SqlSafeStr, SqlStr};

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

/// `begin` (the statements that open a transaction, e.g. [`crate::GENERIC_PLANS`])
/// followed by taking the subscription's exclusive lock, sent together: a claim's
/// transaction starts holding it one round trip sooner. Only integers are written into
/// the text, so it is safe to send as it is.
pub(super) fn begin_locked(begin: &str, subscription_id: SubscriptionId) -> SqlStr {
    AssertSqlSafe(format!(
        "{begin}; SELECT pg_advisory_xact_lock({SUBSCRIPTION_LOCK_CLASS}, {}::int)",
        subscription_id.0
    ))
    .into_sql_str()
}
