//! The `outbox-gateway` command: parses flags, sets up logging and calls the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outbox_gateway::{
    Config, cli,
    config::{LogFormat, Settings},
    storage::{Store, StoreConfig},
};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "outbox-gateway",
    version,
    about = "gRPC gateway for the transactional outbox pattern on PostgreSQL"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the gRPC API (applies pending migrations first unless --no-migrate).
    Serve(Settings),
    /// Apply pending schema migrations and exit.
    Migrate(Settings),
    #[command(flatten)]
    Client(cli::ClientCommand),
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Serve(settings) => match load_config(settings) {
            Ok(config) => serve(config).await,
            Err(code) => return code,
        },
        Command::Migrate(settings) => match load_config(settings) {
            Ok(config) => migrate(config).await,
            Err(code) => return code,
        },
        Command::Client(command) => cli::run(command).await,
    };
    exit_with(result)
}

/// The layered configuration, with logging set up from it; exit code 2 when invalid.
fn load_config(settings: Settings) -> Result<Config, ExitCode> {
    match Config::load(settings) {
        Ok(config) => {
            init_logging(&config);
            Ok(config)
        }
        Err(error) => {
            eprintln!("outbox-gateway: {error}");
            Err(ExitCode::from(2))
        }
    }
}

fn exit_with(result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("outbox-gateway: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> Result<(), String> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|error| format!("cannot listen on {}: {error}", config.listen))?;
    outbox_gateway::run(config, listener, shutdown_signal())
        .await
        .map_err(|error| error.to_string())
}

async fn migrate(config: Config) -> Result<(), String> {
    let target = outbox_gateway::storage::describe_target(&config.database_url);
    let store = Store::connect(&StoreConfig {
        database_url: config.database_url.clone(),
        max_connections: 1,
        acquire_timeout: config.db_acquire_timeout,
    })
    .await
    .map_err(|error| {
        format!("cannot connect to PostgreSQL at {target}: {error}. Point the gateway at your database with --database-url or DATABASE_URL")
    })?;
    store.migrate().await.map_err(|error| error.to_string())?;
    store.close().await;
    println!("schema of {target} is up to date");
    Ok(())
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("can install a SIGTERM handler");
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

fn init_logging(config: &Config) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&config.log_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
