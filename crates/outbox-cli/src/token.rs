//! `token`: generate bearer tokens and hash them for the configuration file.

use serde_json::json;

/// Token management, offline.
#[derive(Debug, clap::Subcommand)]
pub enum TokenCommand {
    /// Print a new random token and the SHA-256 to put in the configuration file.
    Generate {
        /// Name of the token holder, for the printed configuration snippet.
        #[arg(long, default_value = "my-service")]
        name: String,
        /// Role of the token (publisher, subscriber, admin or viewer); repeatable.
        /// `pull` and `tail` need subscriber, the other client commands admin (or viewer
        /// for those that only read). [default: publisher and subscriber]
        #[arg(long = "role", value_enum)]
        roles: Vec<RoleArg>,
        /// Print JSON (token, name, sha256) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the SHA-256 of a token read from standard input.
    Hash {
        /// Print JSON ({"sha256": ...}) instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// A role `token generate` writes into the configuration snippet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleArg {
    Publisher,
    Subscriber,
    Admin,
    Viewer,
}

impl RoleArg {
    fn name(self) -> &'static str {
        match self {
            RoleArg::Publisher => "publisher",
            RoleArg::Subscriber => "subscriber",
            RoleArg::Admin => "admin",
            RoleArg::Viewer => "viewer",
        }
    }
}

pub fn token(command: TokenCommand) -> Result<(), String> {
    match command {
        TokenCommand::Generate { name, roles, json } => {
            let mut roles: Vec<&str> = if roles.is_empty() {
                vec!["publisher", "subscriber"]
            } else {
                roles.into_iter().map(RoleArg::name).collect()
            };
            roles = roles
                .iter()
                .enumerate()
                .filter(|(index, role)| !roles[..*index].contains(role))
                .map(|(_, role)| *role)
                .collect();
            let token: String = (0..32)
                .map(|_| format!("{:02x}", rand::random::<u8>()))
                .collect();
            let sha256 = outbox_domain::auth::token_digest(&token);
            if json {
                println!(
                    "{}",
                    json!({ "token": token, "name": name, "sha256": sha256, "roles": roles })
                );
                return Ok(());
            }
            println!("token:  {token}");
            println!();
            println!("[[tokens]]");
            println!("name = {name:?}");
            println!("sha256 = \"{sha256}\"");
            let roles: Vec<String> = roles.iter().map(|role| format!("{role:?}")).collect();
            println!("roles = [{}]", roles.join(", "));
        }
        TokenCommand::Hash { json } => {
            let mut token = String::new();
            std::io::stdin()
                .read_line(&mut token)
                .map_err(|error| format!("cannot read standard input: {error}"))?;
            let sha256 = outbox_domain::auth::token_digest(token.trim_end_matches(['\r', '\n']));
            if json {
                println!("{}", json!({ "sha256": sha256 }));
            } else {
                println!("{sha256}");
            }
        }
    }
    Ok(())
}
