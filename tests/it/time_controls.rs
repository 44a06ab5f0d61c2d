//! Time controls: pausing and resuming a subscription, expiring events, and scheduling
//! them for later.
//!
//! A paused subscription hands out nothing new on any gateway, while deliveries already
//! out settle as usual; nothing is lost, and a pause with an end resumes by itself. An
//! expired event is counted (and dead-lettered when asked) instead of delivered. A
//! scheduled event arrives not before its time, holds nothing else back, and keeps its
//! aggregate's order.

use std::{
    collections::BTreeSet,
    process::Stdio,
    time::{Duration, SystemTime},
};

use crate::common::*;
use outbox_gateway::proto;
use serde_json::Value;
use tokio::process::Command;
use tonic::Code;

/// Longest wait for something that should arrive; generous for a loaded machine.
const ARRIVES: Duration = Duration::from_secs(30);
/// How long a test watches for something that must not arrive.
const QUIET: Duration = Duration::from_secs(2);

async fn pause(
    gateway: &TestGateway,
    name: &str,
    reason: &str,
    until: Option<prost_types::Timestamp>,
) -> Result<proto::Subscription, tonic::Status> {
    gateway
        .admin()
        .await
        .pause_subscription(proto::PauseSubscriptionRequest {
            name: name.into(),
            reason: reason.into(),
            until,
        })
        .await
        .map(tonic::Response::into_inner)
}

async fn resume(gateway: &TestGateway, name: &str) -> proto::Subscription {
    gateway
        .admin()
        .await
        .resume_subscription(proto::ResumeSubscriptionRequest { name: name.into() })
        .await
        .expect("resume")
        .into_inner()
}

/// `from_now` from now, as a protobuf timestamp.
fn in_(from_now: Duration) -> prost_types::Timestamp {
    prost_types::Timestamp::from(SystemTime::now() + from_now)
}

fn events(prefix: &str, count: usize) -> Vec<proto::EventInput> {
    (0..count)
        .map(|i| event(&format!("{prefix}-{i}"), "order.created"))
        .collect()
}

fn aggregates(deliveries: &[proto::Delivery]) -> BTreeSet<String> {
    deliveries.iter().map(aggregate_of).collect()
}

fn names(prefix: &str, count: usize) -> BTreeSet<String> {
    (0..count).map(|i| format!("{prefix}-{i}")).collect()
}

#[tokio::test]
async fn a_paused_subscription_settles_what_is_out_and_hands_out_nothing_new() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    publish(&gateway, events("before", 3)).await;
    let mut consumer = Consumer::open(&gateway, "work", 10).await;
    let out = consumer.take(3, ARRIVES).await;

    let paused = pause(&gateway, "work", "deploy", None)
        .await
        .expect("pause");
    assert!(paused.paused);
    assert_eq!(paused.pause_reason, "deploy");
    assert!(paused.paused_at.is_some());
    assert_eq!(paused.paused_until, None);
    // Idempotent: the pause keeps when it began.
    let again = pause(&gateway, "work", "deploy", None)
        .await
        .expect("pause");
    assert_eq!(again.paused_at, paused.paused_at);
    assert!(stored_subscription(&gateway, "work").await.paused);

    publish(&gateway, events("during", 3)).await;
    // Acks, extensions and nacks of deliveries already out still apply.
    let stale = ack(&gateway, "work", vec![out[0].ack_id.clone()]).await;
    assert!(stale.is_empty(), "an ack while paused went stale");
    let stale = extend(
        &gateway,
        "work",
        vec![out[1].ack_id.clone()],
        Duration::from_secs(60),
    )
    .await;
    assert!(stale.is_empty(), "an extension while paused went stale");
    let nacked = nack(
        &gateway,
        proto::NackRequest {
            subscription: "work".into(),
            ack_id: out[2].ack_id.clone(),
            reason: "later".into(),
            retry_after: seconds(0),
            dead_letter: false,
        },
    )
    .await;
    assert!(!nacked.dead_lettered);
    // Neither the new events nor the retry go out, and the backlog counts.
    assert!(
        consumer.next(QUIET).await.is_none(),
        "a paused subscription handed out a delivery"
    );
    let stats = gateway
        .admin()
        .await
        .get_stats(proto::GetStatsRequest {
            subscription: "work".into(),
        })
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(stats.subscriptions[0].lag_events, 5, "{stats:?}");

    // Resume: the same stream receives the backlog; nothing was lost.
    let resumed = resume(&gateway, "work").await;
    assert!(!resumed.paused);
    assert_eq!(resumed.pause_reason, "");
    assert_eq!(resumed.paused_at, None);
    let backlog = consumer.take(4, ARRIVES).await;
    let mut expected = names("during", 3);
    expected.insert(aggregate_of(&out[2]));
    assert_eq!(aggregates(&backlog), expected);
    // Resuming an unpaused subscription is a no-op.
    assert!(!resume(&gateway, "work").await.paused);
}

#[tokio::test]
async fn a_pause_with_an_end_resumes_by_itself() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    let mut consumer = Consumer::open(&gateway, "work", 10).await;
    let pause_for = Duration::from_secs(3);
    let until = in_(pause_for);
    let paused = pause(&gateway, "work", "maintenance window", Some(until))
        .await
        .expect("pause");
    let ends = SystemTime::try_from(until).unwrap();
    assert_eq!(
        paused.paused_until.map(|t| t.seconds),
        Some(until.seconds),
        "{paused:?}"
    );
    publish(&gateway, events("held", 2)).await;

    let early = consumer.next(pause_for / 2).await;
    assert!(early.is_none(), "delivered during the pause: {early:?}");
    let deliveries = consumer.take(2, ARRIVES).await;
    assert!(
        SystemTime::now() >= ends,
        "delivered before the pause ended"
    );
    assert_eq!(aggregates(&deliveries), names("held", 2));
    assert!(
        !stored_subscription(&gateway, "work").await.paused,
        "the pause is over"
    );
}

#[tokio::test]
async fn a_pause_holds_on_every_gateway_and_across_restarts() {
    let database = TestDatabase::create().await;
    let mut config = test_config(database.url());
    let poll_interval = Duration::from_secs(1);
    config.delivery.poll_interval = poll_interval;
    let a = TestGateway::start_with(&database, config.clone()).await;
    let b = TestGateway::start_with(&database, config.clone()).await;
    create_subscription(&a, subscription("work")).await;
    let mut on_b = Consumer::open(&b, "work", 10).await;
    publish(&a, events("before", 1)).await;
    let first = on_b.take(1, ARRIVES).await;
    ack_all(&b, "work", vec![first[0].ack_id.clone()]).await;

    pause(&a, "work", "data fix", None).await.expect("pause");
    // The contract gives every gateway one poll interval to notice. Rather than guess
    // how long that takes on a loaded machine, publish probes until one stays with the
    // gateway for two poll intervals: from then on b knows of the pause.
    let noticed = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut probes = 0;
    loop {
        let probe = format!("probe-{probes}");
        probes += 1;
        publish(&a, vec![event(&probe, "order.created")]).await;
        match on_b.next(2 * poll_interval).await {
            None => break,
            Some(early) => ack_all(&b, "work", vec![early.ack_id]).await,
        }
        assert!(
            tokio::time::Instant::now() < noticed,
            "gateway b still delivered a minute after the pause"
        );
    }
    publish(&a, events("during", 3)).await;
    publish(&b, events("during-b", 1)).await;
    let early = on_b.next(QUIET).await;
    assert!(early.is_none(), "the other gateway delivered: {early:?}");
    drop(on_b);

    a.stop().await.expect("stop a");
    b.stop().await.expect("stop b");
    let c = TestGateway::start_with(&database, config).await;
    let restarted = stored_subscription(&c, "work").await;
    assert!(restarted.paused, "the pause did not survive the restart");
    assert_eq!(restarted.pause_reason, "data fix");
    let mut on_c = Consumer::open(&c, "work", 10).await;
    assert!(
        on_c.next(QUIET).await.is_none(),
        "delivered after the restart while paused"
    );

    resume(&c, "work").await;
    let backlog = on_c.take(5, ARRIVES).await;
    let mut expected = names("during", 3);
    expected.extend(names("during-b", 1));
    expected.insert(format!("probe-{}", probes - 1));
    assert_eq!(aggregates(&backlog), expected);
}

#[tokio::test]
async fn bad_pauses_are_refused_and_change_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;

    let past = prost_types::Timestamp::from(SystemTime::now() - Duration::from_secs(60));
    assert_status(
        pause(&gateway, "work", "late", Some(past)).await,
        Code::InvalidArgument,
        "until",
    );
    assert_status(
        pause(&gateway, "work", "nul\0", None).await,
        Code::InvalidArgument,
        "reason",
    );
    assert_status(
        pause(&gateway, "work", &"x".repeat(1025), None).await,
        Code::InvalidArgument,
        "reason",
    );
    assert_status(
        pause(&gateway, "Work!", "", None).await,
        Code::InvalidArgument,
        "name",
    );
    assert_status(
        pause(&gateway, "missing", "", None).await,
        Code::NotFound,
        "missing",
    );
    assert_status(
        gateway
            .admin()
            .await
            .resume_subscription(proto::ResumeSubscriptionRequest {
                name: "missing".into(),
            })
            .await,
        Code::NotFound,
        "missing",
    );
    assert_status(
        gateway
            .admin()
            .await
            .update_subscription(proto::UpdateSubscriptionRequest {
                subscription: Some(proto::Subscription {
                    name: "work".into(),
                    paused: true,
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec!["paused".into()],
                }),
                validate_only: false,
            })
            .await,
        Code::InvalidArgument,
        "PauseSubscription",
    );
    let unchanged = stored_subscription(&gateway, "work").await;
    assert!(!unchanged.paused, "{unchanged:?}");
    assert_eq!(unchanged.pause_reason, "");
}

/// Runs the CLI against `gateway` with `--json`; its JSON answer, or its error text.
async fn cli(gateway: &TestGateway, args: &[&str]) -> Result<Value, String> {
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
        .args(args)
        .arg("--json")
        .env("OUTBOX_ENDPOINT", gateway.endpoint())
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run the CLI");
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&output.stdout).expect("JSON answer"))
}

#[tokio::test]
async fn the_cli_pauses_and_resumes() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;

    let paused = cli(
        &gateway,
        &[
            "subscriptions",
            "pause",
            "work",
            "--until",
            "1h",
            "--reason",
            "downstream outage",
        ],
    )
    .await
    .expect("pause");
    assert_eq!(paused["paused"], true, "{paused}");
    assert_eq!(paused["pause_reason"], "downstream outage");
    let until = chrono::DateTime::parse_from_rfc3339(paused["paused_until"].as_str().unwrap())
        .expect("paused_until");
    let from_now = until.signed_duration_since(chrono::Utc::now());
    assert!(
        from_now > chrono::Duration::minutes(55) && from_now <= chrono::Duration::hours(1),
        "{paused}"
    );
    let at = cli(
        &gateway,
        &[
            "subscriptions",
            "pause",
            "work",
            "--until",
            "2099-01-01T00:00:00Z",
        ],
    )
    .await
    .expect("pause until a time");
    assert_eq!(at["paused_until"], "2099-01-01T00:00:00.000000Z");

    let aged = cli(
        &gateway,
        &[
            "subscriptions",
            "update",
            "work",
            "--max-event-age",
            "10m",
            "--dead-letter-expired",
        ],
    )
    .await
    .expect("update the expiry settings");
    assert_eq!(aged["max_event_age"], "10m", "{aged}");
    assert_eq!(aged["dead_letter_expired"], true);
    assert_eq!(aged["paused"], true, "an update keeps the pause");

    let resumed = cli(&gateway, &["subscriptions", "resume", "work"])
        .await
        .expect("resume");
    assert_eq!(resumed["paused"], false, "{resumed}");

    let refused = cli(
        &gateway,
        &["subscriptions", "pause", "work", "--until", "soon"],
    )
    .await
    .expect_err("a bad --until");
    assert!(refused.contains("soon"), "{refused}");
    let refused = cli(
        &gateway,
        &[
            "subscriptions",
            "pause",
            "work",
            "--until",
            "2000-01-01T00:00:00Z",
        ],
    )
    .await
    .expect_err("an --until in the past");
    assert!(refused.contains("until"), "{refused}");
    assert!(!stored_subscription(&gateway, "work").await.paused);
}

// Expiry.

/// Waits until the subscription has counted `count` expired events.
async fn until_expired(gateway: &TestGateway, name: &str, count: u64) {
    eventually(
        &format!("{name} counts {count} expired events"),
        ARRIVES,
        || async { subscription_stats(gateway, name).await.expired_total == count },
    )
    .await;
}

/// An event that expired a second ago (it occurred an hour ago).
fn already_expired(aggregate_id: &str) -> proto::EventInput {
    proto::EventInput {
        occurred_at: Some(prost_types::Timestamp::from(
            SystemTime::now() - Duration::from_secs(3600),
        )),
        expires_at: Some(prost_types::Timestamp::from(
            SystemTime::now() - Duration::from_secs(1),
        )),
        ..event(aggregate_id, "quote.offered")
    }
}

#[tokio::test]
async fn an_expired_event_is_counted_and_dead_lettered_only_when_asked() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("dropping")).await;
    let keeping = create_subscription(
        &gateway,
        proto::Subscription {
            dead_letter_expired: true,
            ..subscription("keeping")
        },
    )
    .await;
    assert!(keeping.dead_letter_expired);
    publish(
        &gateway,
        vec![already_expired("stale"), event("fresh", "quote.offered")],
    )
    .await;
    let pool = database.pool().await;
    sqlx::query(
        "SELECT outbox_publish('order', 'stale-sql', 'quote.offered', '{}'::jsonb, \
             p_occurred_at => now() - interval '1 hour', p_expires_at => now() - interval '1 minute')",
    )
    .execute(&pool)
    .await
    .expect("a direct writer's expiry");

    for name in ["dropping", "keeping"] {
        let mut consumer = Consumer::open(&gateway, name, 10).await;
        let delivered = consumer.take(1, ARRIVES).await;
        assert_eq!(aggregate_of(&delivered[0]), "fresh");
        until_expired(&gateway, name, 2).await;
        assert!(
            consumer.next(QUIET).await.is_none(),
            "{name} delivered an expired event"
        );
    }
    assert!(list_dead_letters(&gateway, "dropping").await.is_empty());
    let kept = list_dead_letters(&gateway, "keeping").await;
    assert_eq!(kept.len(), 2, "{kept:?}");
    for dead_letter in &kept {
        assert_eq!(dead_letter.last_error, "expired");
        assert!(dead_letter.event.as_ref().unwrap().expires_at.is_some());
    }
}

#[tokio::test]
async fn an_event_past_its_expiry_is_not_redelivered_but_its_ack_succeeds() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            dead_letter_expired: true,
            ..subscription("work")
        },
    )
    .await;
    // Long enough for both deliveries to arrive before it on a loaded machine.
    let lifetime = Duration::from_secs(5);
    let expires_at = in_(lifetime);
    let expires = SystemTime::try_from(expires_at).unwrap();
    let expiring = |id: &str| proto::EventInput {
        expires_at: Some(expires_at),
        ..event(id, "code.issued")
    };
    publish(&gateway, vec![expiring("acked"), expiring("nacked")]).await;
    let mut consumer = Consumer::open(&gateway, "work", 10).await;
    let out = consumer.take(2, ARRIVES).await;
    let delivery = |id: &str| out.iter().find(|d| aggregate_of(d) == id).unwrap().clone();
    assert!(
        SystemTime::now() < expires,
        "the machine is too slow for this test"
    );
    poll_until(ARRIVES, POLL, || async {
        (SystemTime::now() > expires).then_some(())
    })
    .await;

    let stale = ack(&gateway, "work", vec![delivery("acked").ack_id]).await;
    assert!(
        stale.is_empty(),
        "an ack after expiry of a live lease failed"
    );
    nack(
        &gateway,
        proto::NackRequest {
            subscription: "work".into(),
            ack_id: delivery("nacked").ack_id,
            reason: "later".into(),
            retry_after: seconds(0),
            dead_letter: false,
        },
    )
    .await;
    until_expired(&gateway, "work", 1).await;
    assert!(
        consumer.next(QUIET).await.is_none(),
        "redelivered after expiry"
    );
    let kept = list_dead_letters(&gateway, "work").await;
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].last_error, "expired");
    assert_eq!(kept[0].event.as_ref().unwrap().aggregate_id, "nacked");
}

#[tokio::test]
async fn a_subscription_lets_events_older_than_its_max_age_expire() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let created = create_subscription(
        &gateway,
        proto::Subscription {
            max_event_age: seconds(60),
            ..subscription("recent")
        },
    )
    .await;
    assert_eq!(created.max_event_age, seconds(60));
    create_subscription(&gateway, subscription("everything")).await;
    let pool = database.pool().await;
    // A direct writer's rows: one written two minutes ago, one now.
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('price', 'old', 'price.quoted', '{}', now() - interval '2 minutes'), \
                ('price', 'new', 'price.quoted', '{}', now())",
    )
    .execute(&pool)
    .await
    .expect("insert events");

    let mut recent = Consumer::open(&gateway, "recent", 10).await;
    assert_eq!(aggregate_of(&recent.take(1, ARRIVES).await[0]), "new");
    until_expired(&gateway, "recent", 1).await;
    assert!(recent.next(QUIET).await.is_none(), "an old event went out");
    let mut everything = Consumer::open(&gateway, "everything", 10).await;
    assert_eq!(
        aggregates(&everything.take(2, ARRIVES).await),
        BTreeSet::from(["old".to_owned(), "new".to_owned()])
    );
    assert_eq!(
        subscription_stats(&gateway, "everything")
            .await
            .expired_total,
        0
    );

    // The limit can be lifted and the dead-lettering switched on.
    let updated = gateway
        .admin()
        .await
        .update_subscription(proto::UpdateSubscriptionRequest {
            subscription: Some(proto::Subscription {
                name: "recent".into(),
                dead_letter_expired: true,
                ..Default::default()
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["max_event_age".into(), "dead_letter_expired".into()],
            }),
            validate_only: false,
        })
        .await
        .expect("update")
        .into_inner();
    assert_eq!(updated.max_event_age, None);
    assert!(updated.dead_letter_expired);
}

#[tokio::test]
async fn bad_times_are_refused_and_write_nothing() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let pool = database.pool().await;
    let refused = |input: proto::EventInput| {
        let gateway = &gateway;
        async move {
            gateway
                .publisher()
                .await
                .publish(proto::PublishRequest {
                    events: vec![event("ok", "order.created"), input],
                    ..Default::default()
                })
                .await
        }
    };
    let hour = Duration::from_secs(3600);
    assert_status(
        refused(proto::EventInput {
            occurred_at: Some(in_(hour)),
            expires_at: Some(in_(hour / 2)),
            ..event("o", "order.created")
        })
        .await,
        Code::InvalidArgument,
        "events[1].expires_at",
    );
    assert_status(
        refused(proto::EventInput {
            expires_at: Some(prost_types::Timestamp::from(SystemTime::now() - hour)),
            ..event("o", "order.created")
        })
        .await,
        Code::InvalidArgument,
        "events[1].expires_at",
    );
    assert_status(
        refused(proto::EventInput {
            deliver_at: Some(in_(hour * 2)),
            expires_at: Some(in_(hour)),
            ..event("o", "order.created")
        })
        .await,
        Code::InvalidArgument,
        "events[1].expires_at",
    );
    assert_status(
        refused(proto::EventInput {
            deliver_at: Some(in_(hour * 24 * 91)),
            ..event("o", "order.created")
        })
        .await,
        Code::InvalidArgument,
        "events[1].deliver_at",
    );
    assert_eq!(count_events(&pool).await, 0, "a refused batch wrote events");

    for (age, name) in [
        (
            prost_types::Duration {
                seconds: -5,
                nanos: 0,
            },
            "negative",
        ),
        (
            prost_types::Duration {
                seconds: 0,
                nanos: 0,
            },
            "zero",
        ),
        (
            prost_types::Duration {
                seconds: 200 * 365 * 24 * 3600,
                nanos: 0,
            },
            "ages",
        ),
    ] {
        assert_status(
            gateway
                .admin()
                .await
                .create_subscription(proto::CreateSubscriptionRequest {
                    subscription: Some(proto::Subscription {
                        max_event_age: Some(age),
                        ..subscription(name)
                    }),
                    validate_only: false,
                })
                .await,
            Code::InvalidArgument,
            "subscription.max_event_age",
        );
    }
    let listed = gateway
        .admin()
        .await
        .list_subscriptions(proto::ListSubscriptionsRequest {})
        .await
        .expect("list")
        .into_inner();
    assert!(listed.subscriptions.is_empty());
}

// Scheduled events.

#[tokio::test]
async fn a_scheduled_event_arrives_on_time_while_others_flow() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    let mut consumer = Consumer::open(&gateway, "work", 10).await;
    let delay = Duration::from_secs(3);
    let deliver_at = in_(delay);
    let due = SystemTime::try_from(deliver_at).unwrap();
    publish(
        &gateway,
        vec![
            proto::EventInput {
                deliver_at: Some(deliver_at),
                ..event("later", "reminder.due")
            },
            event("now-1", "order.created"),
        ],
    )
    .await;
    // A direct writer's scheduled rows, through the function and a plain insert.
    let pool = database.pool().await;
    sqlx::query(
        "SELECT outbox_publish('reminder', 'later-sql', 'reminder.due', '{}'::jsonb, \
             p_deliver_at => $1)",
    )
    .bind(chrono::DateTime::<chrono::Utc>::from(due))
    .execute(&pool)
    .await
    .expect("outbox_publish with deliver_at");
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, deliver_at) \
         VALUES ('reminder', 'later-insert', 'reminder.due', '{}', $1)",
    )
    .bind(chrono::DateTime::<chrono::Utc>::from(due))
    .execute(&pool)
    .await
    .expect("insert with deliver_at");
    publish(&gateway, vec![event("now-2", "order.created")]).await;

    let unscheduled = consumer.take(2, ARRIVES).await;
    assert_eq!(aggregates(&unscheduled), names("now", 3).split_off("now-1"));
    eventually("stats show the scheduled events", ARRIVES, || async {
        let stats = subscription_stats(&gateway, "work").await;
        stats.scheduled == 3
            && stats
                .next_scheduled_at
                .is_some_and(|at| at.seconds == deliver_at.seconds)
    })
    .await;

    let scheduled = consumer.take(3, ARRIVES).await;
    let arrived = SystemTime::now();
    assert!(arrived >= due, "a scheduled event arrived early");
    assert!(
        arrived < due + Duration::from_secs(5),
        "scheduled events arrived {:?} late",
        arrived.duration_since(due).unwrap()
    );
    assert_eq!(
        aggregates(&scheduled),
        BTreeSet::from(["later".into(), "later-sql".into(), "later-insert".into()])
    );
    for delivery in &scheduled {
        assert_eq!(delivery.attempt, 1, "a scheduled event's first delivery");
    }
    assert!(
        scheduled
            .iter()
            .all(|delivery| delivery.event.as_ref().unwrap().deliver_at.is_some())
    );
    let stats = subscription_stats(&gateway, "work").await;
    assert_eq!((stats.scheduled, stats.next_scheduled_at), (0, None));
}

#[tokio::test]
async fn an_ordered_aggregate_keeps_its_order_across_a_scheduled_event() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ordered: true,
            ..subscription("ordered")
        },
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "ordered", 10).await;
    let delay = Duration::from_secs(3);
    let due = SystemTime::now() + delay;
    let scheduled = proto::EventInput {
        deliver_at: Some(in_(delay)),
        ..event("x", "step.two")
    };
    publish(
        &gateway,
        vec![
            event("x", "step.one"),
            scheduled,
            event("x", "step.three"),
            event("y", "step.one"),
        ],
    )
    .await;
    let step = |delivery: &proto::Delivery| {
        let event = delivery.event.as_ref().unwrap();
        format!("{}:{}", event.aggregate_id, event.event_type)
    };
    let first = consumer.take(2, ARRIVES).await;
    assert_eq!(
        first.iter().map(step).collect::<BTreeSet<_>>(),
        BTreeSet::from(["x:step.one".into(), "y:step.one".into()])
    );
    for delivery in &first {
        ack_all(&gateway, "ordered", vec![delivery.ack_id.clone()]).await;
    }
    let second = consumer.take(1, ARRIVES).await;
    assert!(SystemTime::now() >= due, "the scheduled event came early");
    assert_eq!(step(&second[0]), "x:step.two");
    assert!(
        consumer.next(QUIET).await.is_none(),
        "the aggregate's next event overtook its unacked predecessor"
    );
    ack_all(&gateway, "ordered", vec![second[0].ack_id.clone()]).await;
    let third = consumer.take(1, ARRIVES).await;
    assert_eq!(step(&third[0]), "x:step.three");
}

fn age(duration: Option<prost_types::Duration>) -> Duration {
    duration
        .and_then(|duration| Duration::try_from(duration).ok())
        .unwrap_or_default()
}

#[tokio::test]
async fn scheduled_events_are_not_lag_and_due_ones_age_from_their_time() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    publish(
        &gateway,
        vec![proto::EventInput {
            deliver_at: Some(in_(Duration::from_secs(15 * 60))),
            ..event("later", "order.created")
        }],
    )
    .await;
    // Written ten minutes ago, due only a second ago: it has waited a second.
    sqlx::query(
        "INSERT INTO outbox_events \
             (aggregate_type, aggregate_id, event_type, payload, created_at, deliver_at) \
         VALUES ('order', 'due', 'order.created', '{}', \
                 now() - interval '10 minutes', now() - interval '1 second')",
    )
    .execute(&database.pool().await)
    .await
    .expect("insert a due event");

    let stats = subscription_stats(&gateway, "work").await;
    assert_eq!(stats.scheduled, 1, "{stats:?}");
    assert_eq!(stats.pending, 1, "only the due event is pending: {stats:?}");
    assert_eq!(stats.lag_events, 1, "{stats:?}");
    let oldest = age(stats.oldest_unacked_age);
    assert!(
        oldest < Duration::from_secs(5 * 60),
        "the due event aged from its creation: {oldest:?}"
    );

    let mut consumer = Consumer::open(&gateway, "work", 10).await;
    let due = consumer.take(1, ARRIVES).await;
    assert_eq!(aggregate_of(&due[0]), "due");
    ack_all(&gateway, "work", vec![due[0].ack_id.clone()]).await;
    // Claimed by the stream, the scheduled event waits in a record of its own: still
    // no lag, and nothing unacked.
    eventually("only the scheduled event is left", ARRIVES, || async {
        let stats = subscription_stats(&gateway, "work").await;
        stats.acked_total == 1
            && stats.scheduled == 1
            && stats.pending == 0
            && stats.lag_events == 0
            && age(stats.oldest_unacked_age).is_zero()
            && age(stats.lag).is_zero()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_events_scheduled_ahead_do_not_hold_back_the_others() {
    const SCHEDULED: i64 = 100_000;
    const PLAIN: usize = 2_000;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(&gateway, subscription("work")).await;
    let pool = database.pool().await;
    sqlx::query(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, deliver_at) \
         SELECT 'reminder', 'r-' || n, 'reminder.due', '{}', now() + interval '1 hour' \
         FROM generate_series(1, $1) AS n",
    )
    .bind(SCHEDULED)
    .execute(&pool)
    .await
    .expect("schedule events");
    for chunk in 0..PLAIN / 500 {
        publish(&gateway, events(&format!("plain{chunk}"), 500)).await;
    }

    let started = std::time::Instant::now();
    let mut consumer = Consumer::open(&gateway, "work", 1000).await;
    let mut received = 0;
    while received < PLAIN {
        let batch = consumer.take(1, Duration::from_secs(60)).await;
        received += 1;
        assert_eq!(batch[0].event.as_ref().unwrap().aggregate_type, "order");
        ack_all(&gateway, "work", vec![batch[0].ack_id.clone()]).await;
    }
    let took = started.elapsed();
    println!("{PLAIN} events behind {SCHEDULED} scheduled ones delivered and acked in {took:?}");
    assert!(
        took < Duration::from_secs(120),
        "the scheduled events held the others back for {took:?}"
    );
    let stats = subscription_stats(&gateway, "work").await;
    assert_eq!(stats.scheduled, SCHEDULED as u64);
    assert_eq!(
        stats.pending, 0,
        "scheduled events are not pending: {stats:?}"
    );
    assert!(
        consumer.next(QUIET).await.is_none(),
        "a scheduled event came early"
    );
}

async fn stored_event(gateway: &TestGateway, id: &str) -> proto::Event {
    gateway
        .admin()
        .await
        .get_event(proto::GetEventRequest {
            id: id.into(),
            ..Default::default()
        })
        .await
        .expect("get event")
        .into_inner()
        .event
        .expect("event")
}

#[tokio::test]
async fn the_cli_publishes_scheduled_and_expiring_events() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let flags = [
        "publish",
        "--aggregate-type",
        "order",
        "--aggregate-id",
        "o-1",
        "--event-type",
        "order.remind",
    ];
    let published_at = SystemTime::now();
    let delayed = cli(
        &gateway,
        &[&flags[..], &["--delay", "1h", "--ttl", "10m"]].concat(),
    )
    .await
    .expect("publish --delay --ttl");
    let event = stored_event(&gateway, delayed["id"].as_str().unwrap()).await;
    let deliver_at = event.deliver_at.expect("deliver_at");
    let expires_at = event.expires_at.expect("expires_at");
    let hour_later = prost_types::Timestamp::from(published_at + Duration::from_secs(3600));
    assert!(
        (deliver_at.seconds - hour_later.seconds).abs() <= 60,
        "{event:?}"
    );
    assert_eq!(
        expires_at.seconds - deliver_at.seconds,
        600,
        "the ttl counts from delivery"
    );

    let at = cli(
        &gateway,
        &[
            &flags[..],
            &[
                "--deliver-at",
                "2099-01-01T00:00:00Z",
                "--expires-at",
                "2099-01-02T00:00:00Z",
            ],
        ]
        .concat(),
    )
    .await;
    // Beyond the default 90 days ahead.
    let refused = at.expect_err("deliver_at too far ahead");
    assert!(refused.contains("deliver_at"), "{refused}");

    let expiring = cli(&gateway, &[&flags[..], &["--ttl", "30s"]].concat())
        .await
        .expect("publish --ttl");
    let event = stored_event(&gateway, expiring["id"].as_str().unwrap()).await;
    assert_eq!(event.deliver_at, None);
    assert!(event.expires_at.is_some());

    let conflict = cli(
        &gateway,
        &[
            &flags[..],
            &["--delay", "1m", "--deliver-at", "2099-01-01T00:00:00Z"],
        ]
        .concat(),
    )
    .await
    .expect_err("--delay with --deliver-at");
    assert!(
        conflict.contains("--delay") || conflict.contains("--deliver-at"),
        "{conflict}"
    );
    let reversed = cli(
        &gateway,
        &[
            &flags[..],
            &["--delay", "1h", "--expires-at", "2000-01-01T00:00:00Z"],
        ]
        .concat(),
    )
    .await
    .expect_err("an expiry before delivery");
    assert!(reversed.contains("expires_at"), "{reversed}");
    assert_eq!(count_events(&database.pool().await).await, 2);
}

#[tokio::test]
async fn an_event_that_expires_while_waiting_in_order_frees_its_aggregate() {
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    create_subscription(
        &gateway,
        proto::Subscription {
            ordered: true,
            ..subscription("ordered")
        },
    )
    .await;
    let expires_at = in_(Duration::from_secs(2));
    let expires = SystemTime::try_from(expires_at).unwrap();
    publish(
        &gateway,
        vec![
            event("x", "step.one"),
            proto::EventInput {
                expires_at: Some(expires_at),
                ..event("x", "step.two")
            },
            event("x", "step.three"),
        ],
    )
    .await;
    let mut consumer = Consumer::open(&gateway, "ordered", 10).await;
    let first = consumer.take(1, ARRIVES).await;
    assert_eq!(first[0].event.as_ref().unwrap().event_type, "step.one");
    poll_until(ARRIVES, POLL, || async {
        (SystemTime::now() > expires).then_some(())
    })
    .await;
    ack_all(&gateway, "ordered", vec![first[0].ack_id.clone()]).await;
    let next = consumer.take(1, ARRIVES).await;
    assert_eq!(
        next[0].event.as_ref().unwrap().event_type,
        "step.three",
        "the expired event went out, or held its aggregate"
    );
    assert_eq!(
        subscription_stats(&gateway, "ordered").await.expired_total,
        1
    );
}

#[tokio::test]
async fn the_cli_takes_times_per_line_from_standard_input() {
    use tokio::io::AsyncWriteExt;
    let database = TestDatabase::create().await;
    let gateway = TestGateway::start(&database).await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-gateway"))
        .args(["publish", "--stdin", "--ttl", "1h", "--json"])
        .env("OUTBOX_ENDPOINT", gateway.endpoint())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the CLI");
    let deliver_at = chrono::Utc::now() + chrono::Duration::minutes(5);
    let lines = format!(
        "{{\"aggregate_type\":\"order\",\"aggregate_id\":\"o-1\",\"event_type\":\"order.remind\",\"deliver_at\":\"{}\"}}\n\
         {{\"aggregate_type\":\"order\",\"aggregate_id\":\"o-2\",\"event_type\":\"order.remind\"}}\n",
        deliver_at.to_rfc3339()
    );
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(lines.as_bytes()).await.unwrap();
    drop(stdin);
    let output = child.wait_with_output().await.unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let ids: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            serde_json::from_str::<Value>(line).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let scheduled = stored_event(&gateway, &ids[0]).await;
    assert_eq!(
        scheduled.deliver_at.map(|at| at.seconds),
        Some(deliver_at.timestamp())
    );
    // The TTL counts from the line's own delivery time.
    assert_eq!(
        scheduled.expires_at.unwrap().seconds - scheduled.deliver_at.unwrap().seconds,
        3600
    );
    let plain = stored_event(&gateway, &ids[1]).await;
    assert_eq!(plain.deliver_at, None);
    assert!(plain.expires_at.is_some());
}
