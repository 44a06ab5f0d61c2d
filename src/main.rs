//! The `outbox-gateway` command: parses flags, sets up logging and calls the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outbox_gateway::{
    Config, cli,
    config::{MigrateSettings, Settings},
    local_database,
    telemetry::Telemetry,
};
use tokio::net::TcpListener;

// Every Publish decodes and frees thousands of small strings and maps; glibc's malloc
// spent a fifth of the gateway's CPU on them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

// Parsed once at start-up: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve the gRPC API (applies pending migrations first unless --no-migrate).
    Serve(Settings),
    /// Apply pending schema migrations to every source database (or one) and exit.
    Migrate(MigrateArgs),
    #[command(flatten)]
    Client(cli::ClientCommand),
    /// Create or hash bearer tokens for the configuration file.
    #[command(subcommand)]
    Token(cli::TokenCommand),
    /// Save, list, select or delete connection profiles (endpoint, token, TLS files).
    #[command(subcommand)]
    Context(cli::context::ContextCommand),
}

#[derive(clap::Args)]
struct MigrateArgs {
    /// Only this source (a `[[sources]]` name, or `default` for --database-url); every
    /// source when omitted.
    #[arg(long, value_name = "NAME")]
    source: Option<String>,
    #[command(flatten)]
    settings: MigrateSettings,
}

#[tokio::main]
async fn main() -> ExitCode {
    let command = Cli::parse().command;
    if !matches!(command, Command::Serve(_) | Command::Migrate(_)) {
        cli::exit_quietly_on_closed_stdout();
    }
    let result = match command {
        Command::Serve(settings) => match load_config(settings) {
            Ok(config) => serve(config).await,
            Err(code) => return code,
        },
        Command::Migrate(args) => match load_config(args.settings.into()) {
            Ok(config) => {
                if let Some(Err(message)) = args.source.as_deref().map(|name| {
                    outbox_gateway::sources::check_source_name(&config.sources_settings(), name)
                }) {
                    eprintln!("outbox-gateway: {message}");
                    return ExitCode::from(2);
                }
                migrate(config, args.source).await
            }
            Err(code) => return code,
        },
        Command::Client(command) => match cli::run(command).await {
            Ok(()) => Ok(()),
            Err(error) => {
                eprintln!("outbox-gateway: {}", error.message());
                return ExitCode::from(error.exit_code());
            }
        },
        Command::Token(command) => cli::token(command),
        Command::Context(command) => cli::context::run(command),
    };
    exit_with(result)
}

/// The layered configuration; exit code 2 when invalid.
fn load_config(settings: Settings) -> Result<Config, ExitCode> {
    Config::load(settings).map_err(|error| {
        eprintln!("outbox-gateway: {error}");
        ExitCode::from(2)
    })
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

async fn serve(mut config: Config) -> Result<(), String> {
    let telemetry = Telemetry::init(config.log_format, &config.log_level)?;
    let local_database = local_database::start_if_needed(&mut config).await?;
    let result = match TcpListener::bind(config.listen).await {
        Ok(listener) => outbox_gateway::run(config, listener, shutdown_signal())
            .await
            .map_err(|error| error.to_string()),
        Err(error) => Err(format!(
            "cannot listen on {}: {error}. Choose another address with --listen (OUTBOX_LISTEN, or listen in the configuration file)",
            config.listen
        )),
    };
    if let Some(local_database) = local_database
        && let Err(message) = local_database.stop().await
    {
        tracing::error!("{message}");
    }
    telemetry.shutdown();
    result
}

async fn migrate(config: Config, only: Option<String>) -> Result<(), String> {
    Telemetry::init(config.log_format, &config.log_level)?;
    for line in
        outbox_gateway::sources::migrate(&config.sources_settings(), only.as_deref()).await?
    {
        println!("{line}");
    }
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
