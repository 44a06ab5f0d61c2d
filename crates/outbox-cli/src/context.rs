//! Connection profiles ("contexts"), like `nats context`: an endpoint, a token and TLS
//! files saved under a name in `contexts.toml` in the user's configuration directory
//! (`$XDG_CONFIG_HOME/outbox-gateway`, else `~/.config/outbox-gateway`). A command uses
//! the one named by `--context` or `OUTBOX_CONTEXT`, else the one chosen with
//! `context select`; its own flags and environment variables win over the profile.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use serde_json::json;

/// The contexts file.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextFile {
    /// The context used when none is named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

/// One saved connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct Context {
    /// The gateway's endpoint (http://HOST:PORT, https://HOST:PORT or HOST:PORT).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Bearer token (stored in the file, readable only by you).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// PEM CA certificate that signed the gateway's certificate.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    /// PEM client certificate, for gateways that require mutual TLS.
    #[arg(long, requires = "key")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// PEM private key of --cert.
    #[arg(long, requires = "cert")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
}

/// Context management, offline.
#[derive(Debug, clap::Subcommand)]
pub enum ContextCommand {
    /// Save (or replace) a context.
    Save {
        /// Its name.
        name: String,
        #[command(flatten)]
        context: Context,
        /// Also make it the context used when none is named.
        #[arg(long)]
        select: bool,
    },
    /// List the saved contexts; the selected one is marked.
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Use this context when none is named.
    Select {
        /// A saved context.
        name: String,
    },
    /// Delete a saved context.
    Delete {
        /// A saved context.
        name: String,
    },
}

/// Where contexts are saved.
pub fn file_path() -> Result<PathBuf, String> {
    let base = match std::env::var_os("XDG_CONFIG_HOME").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => match std::env::var_os("HOME").filter(|dir| !dir.is_empty()) {
            Some(home) => Path::new(&home).join(".config"),
            None => {
                return Err(
                    "cannot find your configuration directory: set XDG_CONFIG_HOME or HOME".into(),
                );
            }
        },
    };
    Ok(base.join("outbox-gateway").join("contexts.toml"))
}

/// The saved contexts; none when the file does not exist yet.
pub fn load() -> Result<ContextFile, String> {
    let path = file_path()?;
    match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str(&text)
            .map_err(|error| format!("cannot read the contexts in {}: {error}", path.display())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(ContextFile::default()),
        Err(error) => Err(format!("cannot read {}: {error}", path.display())),
    }
}

fn save(file: &ContextFile) -> Result<(), String> {
    let path = file_path()?;
    let cannot = |error: std::io::Error| format!("cannot write {}: {error}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(cannot)?;
    }
    let text = toml::to_string(file).map_err(|error| format!("cannot save contexts: {error}"))?;
    // Tokens are secrets: the file is readable by its owner only.
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut written = options.open(&path).map_err(cannot)?;
    std::io::Write::write_all(&mut written, text.as_bytes()).map_err(cannot)
}

/// The context a command uses: the one it names (`--context` / `OUTBOX_CONTEXT`), else
/// the selected one, else none.
pub fn chosen(named: Option<&str>) -> Result<Option<Context>, String> {
    let file = load()?;
    let Some(name) = named.or(file.current.as_deref()) else {
        return Ok(None);
    };
    match file.contexts.get(name) {
        Some(context) => Ok(Some(context.clone())),
        None => Err(format!(
            "no context named {name:?} (--context / OUTBOX_CONTEXT); saved: {}",
            names(&file)
        )),
    }
}

fn names(file: &ContextFile) -> String {
    if file.contexts.is_empty() {
        "none yet (outbox-gateway context save NAME --endpoint ...)".into()
    } else {
        file.contexts.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// Checks a context name: it is typed on command lines and used as a TOML key.
fn check_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "context name {name:?}: use 1 to 64 letters, digits, '-', '_' or '.'"
        ))
    }
}

pub fn run(command: ContextCommand) -> Result<(), String> {
    match command {
        ContextCommand::Save {
            name,
            context,
            select,
        } => {
            check_name(&name)?;
            if context.endpoint.is_none() && context.token.is_none() && context.ca.is_none() {
                return Err("give at least --endpoint, --token or --ca to save".into());
            }
            let mut file = load()?;
            file.contexts.insert(name.clone(), context);
            if select {
                file.current = Some(name.clone());
            }
            save(&file)?;
            println!(
                "saved context {name}{} in {}",
                if select { " and selected it" } else { "" },
                file_path()?.display()
            );
        }
        ContextCommand::List { json } => {
            let file = load()?;
            if json {
                let contexts: Vec<_> = file
                    .contexts
                    .iter()
                    .map(|(name, context)| {
                        json!({
                            "name": name,
                            "selected": file.current.as_deref() == Some(name),
                            "endpoint": context.endpoint,
                            "token": context.token.is_some(),
                            "ca": context.ca,
                            "cert": context.cert,
                            "key": context.key,
                        })
                    })
                    .collect();
                println!("{}", json!(contexts));
                return Ok(());
            }
            let rows: Vec<Vec<String>> = file
                .contexts
                .iter()
                .map(|(name, context)| {
                    let marked = if file.current.as_deref() == Some(name) {
                        format!("{name} *")
                    } else {
                        name.clone()
                    };
                    vec![
                        marked,
                        context.endpoint.clone().unwrap_or_else(|| "-".into()),
                        if context.token.is_some() {
                            "set".into()
                        } else {
                            "-".into()
                        },
                        context
                            .ca
                            .as_ref()
                            .map_or("-".into(), |ca| ca.display().to_string()),
                    ]
                })
                .collect();
            super::render::table(&["NAME", "ENDPOINT", "TOKEN", "CA"], &rows);
        }
        ContextCommand::Select { name } => {
            let mut file = load()?;
            if !file.contexts.contains_key(&name) {
                return Err(format!(
                    "no context named {name:?}; saved: {}",
                    names(&file)
                ));
            }
            file.current = Some(name.clone());
            save(&file)?;
            println!("using context {name} when none is named");
        }
        ContextCommand::Delete { name } => {
            let mut file = load()?;
            if file.contexts.remove(&name).is_none() {
                return Err(format!(
                    "no context named {name:?}; saved: {}",
                    names(&file)
                ));
            }
            if file.current.as_deref() == Some(name.as_str()) {
                file.current = None;
            }
            save(&file)?;
            println!("deleted context {name}");
        }
    }
    Ok(())
}
