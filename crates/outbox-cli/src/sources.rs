//! `sources`: the source databases and whether each can be reached.

use serde_json::Value;

use outbox_client::proto;

use crate::{Target, describe, render};

pub(crate) async fn sources(target: &Target) -> Result<(), String> {
    let mut admin = target.connect(true).await?.admin();
    let sources = admin
        .list_sources(proto::ListSourcesRequest {})
        .await
        .map_err(describe)?
        .into_inner()
        .sources;
    target.print(
        Value::Array(sources.iter().map(render::source).collect()),
        || render::sources_table(&sources),
    );
    Ok(())
}
