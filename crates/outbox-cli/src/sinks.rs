//! `sinks`: the brokers of the gateway's configuration and whether each is reachable.

use serde_json::{Value, json};

use outbox_client::proto;

use crate::{Target, describe, render};

pub(crate) async fn sinks(target: &Target) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    let sinks = admin
        .list_sinks(proto::ListSinksRequest {})
        .await
        .map_err(describe)?
        .into_inner()
        .sinks;
    let status = |sink: &proto::Sink| {
        if sink.reachable {
            "reachable"
        } else {
            "unreachable"
        }
    };
    target.print(
        Value::Array(
            sinks
                .iter()
                .map(|sink| {
                    json!({
                        "name": sink.name,
                        "kind": sink.kind,
                        "status": status(sink),
                        "error": sink.error,
                    })
                })
                .collect(),
        ),
        || {
            if sinks.is_empty() {
                println!("no sinks: add [[sinks]] tables to the gateway's configuration file");
                return;
            }
            let rows: Vec<Vec<String>> = sinks
                .iter()
                .map(|sink| {
                    vec![
                        sink.name.clone(),
                        sink.kind.clone(),
                        status(sink).to_owned(),
                        sink.error.clone(),
                    ]
                })
                .collect();
            render::table(&["SINK", "KIND", "STATUS", "ERROR"], &rows);
        },
    );
    Ok(())
}
