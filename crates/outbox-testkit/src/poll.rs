//! Waiting for a condition by polling with a deadline.

use std::{future::Future, time::Duration};

use tokio::time::Instant;

/// Calls `check` every `interval` until it returns `Some`, for at most `within`; `None`
/// when the deadline passed first. One last check runs at the deadline, so a condition
/// that comes true just in time is not missed.
pub async fn poll_until<T, F, Fut>(within: Duration, interval: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(interval.min(deadline.saturating_duration_since(Instant::now()))).await;
    }
}

/// Reads `read` every `interval` until its value has stayed the same for `quiet`, for at
/// most `within`; returns the last value read. For figures others update late, such as
/// table statistics, which sessions flush when they go idle or end.
pub async fn settled<T, E, F, Fut>(
    quiet: Duration,
    within: Duration,
    interval: Duration,
    mut read: F,
) -> Result<T, E>
where
    T: PartialEq,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    let mut last = read().await?;
    let mut unchanged_since = started;
    while unchanged_since.elapsed() < quiet && started.elapsed() < within {
        tokio::time::sleep(interval).await;
        let now = read().await?;
        if now != last {
            (last, unchanged_since) = (now, Instant::now());
        }
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_the_first_value_within_the_deadline() {
        let calls = AtomicU32::new(0);
        let value = poll_until(
            Duration::from_secs(1),
            Duration::from_millis(10),
            || async {
                let call = calls.fetch_add(1, Ordering::Relaxed) + 1;
                (call == 3).then_some(call)
            },
        )
        .await;
        assert_eq!(value, Some(3));
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_the_deadline() {
        let started = Instant::now();
        let value: Option<()> = poll_until(
            Duration::from_millis(100),
            Duration::from_millis(30),
            || async { None },
        )
        .await;
        assert_eq!(value, None);
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(started.elapsed() < Duration::from_millis(150));
    }

    #[tokio::test(start_paused = true)]
    async fn settled_waits_until_the_value_stops_moving() {
        // 1, 2, 3, then 3 for good: read every 10 ms, quiet for 50 ms.
        let calls = AtomicU32::new(0);
        let started = Instant::now();
        let value = settled(
            Duration::from_millis(50),
            Duration::from_secs(1),
            Duration::from_millis(10),
            || async { Ok::<_, ()>((calls.fetch_add(1, Ordering::Relaxed) + 1).min(3)) },
        )
        .await;
        assert_eq!(value, Ok(3));
        assert!(started.elapsed() >= Duration::from_millis(70));
    }

    #[tokio::test(start_paused = true)]
    async fn settled_gives_up_moving_values_after_within() {
        let calls = AtomicU32::new(0);
        let started = Instant::now();
        let value = settled(
            Duration::from_millis(50),
            Duration::from_millis(200),
            Duration::from_millis(10),
            || async { Ok::<_, ()>(calls.fetch_add(1, Ordering::Relaxed)) },
        )
        .await;
        assert!(value.unwrap() >= 19);
        assert!(started.elapsed() < Duration::from_millis(250));
    }
}
