//! Compiles `proto/` with a pure-Rust protobuf compiler, so building needs no system `protoc`.

use std::{env, fs, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["outbox/v1/outbox.proto"];
    println!("cargo:rerun-if-changed=proto");

    let descriptors = protox::compile(protos, ["proto"])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    // The same descriptor set serves the gateway's gRPC server reflection.
    fs::write(
        out_dir.join("outbox_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Clients need no server stubs, and without them no tonic server code.
        .server_mod_attribute("outbox.v1", r#"#[cfg(feature = "server")]"#)
        .compile_fds(descriptors)?;
    Ok(())
}
