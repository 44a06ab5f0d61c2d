//! Which database servers the relay can serve, decided from what a server says of itself
//! at start: a read-only server, a pooler that shares one server session between
//! clients, a PostgreSQL older than 13 or an engine that only speaks PostgreSQL's
//! protocol would each fail later in a way that hides the cause (a write refused deep in
//! a migration, a prepared statement that "already exists", notifications that never
//! arrive). See docs/engines.md.

use std::fmt;

/// The oldest PostgreSQL the relay runs on: it orders events by `xid8` and reads
/// `pg_current_snapshot()`, both new in 13.
pub const OLDEST_SUPPORTED_VERSION_NUM: u32 = 130_000;

/// What a server answered about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFacts {
    /// `SELECT version()`: names engines that answer as PostgreSQL but are not.
    pub version: String,
    /// `server_version_num`, e.g. 150004.
    pub version_num: u32,
    /// `transaction_read_only`: a hot standby, or a server set read-only.
    pub read_only: bool,
    /// `pg_is_in_recovery()`: a hot standby in particular.
    pub in_recovery: bool,
    /// Two client sessions met the same server session, or one session moved to
    /// another: a pooler in transaction or statement mode is in between.
    pub sessions_shared: bool,
}

/// Why the relay cannot use a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineProblem {
    /// CockroachDB, YugabyteDB and the like: PostgreSQL's protocol, not its snapshots.
    Unsupported {
        engine: &'static str,
    },
    TooOld {
        version: String,
    },
    ReadOnly {
        in_recovery: bool,
    },
    TransactionPooler,
}

/// Engines that answer as PostgreSQL, by what their `version()` says.
const UNSUPPORTED_ENGINES: [(&str, &str); 2] =
    [("CockroachDB", "CockroachDB"), ("-YB-", "YugabyteDB")];

impl EngineFacts {
    /// The first reason the relay cannot use this server, most fundamental first: an
    /// engine that is not PostgreSQL, then one too old, then how it is reached.
    pub fn problem(&self) -> Option<EngineProblem> {
        if let Some((_, engine)) = UNSUPPORTED_ENGINES
            .iter()
            .find(|(marker, _)| self.version.contains(marker))
        {
            return Some(EngineProblem::Unsupported { engine });
        }
        if self.version_num < OLDEST_SUPPORTED_VERSION_NUM {
            return Some(EngineProblem::TooOld {
                version: short_version(&self.version, self.version_num),
            });
        }
        if self.read_only || self.in_recovery {
            return Some(EngineProblem::ReadOnly {
                in_recovery: self.in_recovery,
            });
        }
        if self.sessions_shared {
            return Some(EngineProblem::TransactionPooler);
        }
        None
    }
}

/// "PostgreSQL 12.17" out of `version()`'s "PostgreSQL 12.17 on x86_64-pc-linux-gnu, …",
/// or the number when the text says nothing usable.
fn short_version(version: &str, version_num: u32) -> String {
    let mut words = version.split_whitespace();
    match (words.next(), words.next()) {
        (Some(name), Some(number)) if number.starts_with(|c: char| c.is_ascii_digit()) => {
            format!("{name} {}", number.trim_end_matches(','))
        }
        _ => format!("server_version_num {version_num}"),
    }
}

impl fmt::Display for EngineProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineProblem::Unsupported { engine } => write!(
                f,
                "{engine} is not supported: the relay needs PostgreSQL's transaction snapshots (xid8, pg_current_snapshot), LISTEN/NOTIFY and SKIP LOCKED; see docs/engines.md"
            ),
            EngineProblem::TooOld { version } => write!(
                f,
                "{version} is older than PostgreSQL 13, the oldest the relay runs on (it needs the xid8 type and pg_current_snapshot()): upgrade the server"
            ),
            EngineProblem::ReadOnly { in_recovery } => write!(
                f,
                "the server is read-only ({}): the relay writes delivery state there, so connect to the primary / writer endpoint",
                if *in_recovery {
                    "a hot standby or read replica"
                } else {
                    "transaction_read_only is on"
                }
            ),
            EngineProblem::TransactionPooler => write!(
                f,
                "the connection goes through a pooler in transaction or statement mode (two sessions of the gateway shared one server session): LISTEN/NOTIFY does not round-trip and session state is lost; connect directly, or use session pooling"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn postgres(version_num: u32) -> EngineFacts {
        EngineFacts {
            version: format!(
                "PostgreSQL {}.{} on x86_64-pc-linux-gnu, compiled by gcc",
                version_num / 10_000,
                version_num % 100
            ),
            version_num,
            read_only: false,
            in_recovery: false,
            sessions_shared: false,
        }
    }

    #[test]
    fn a_writable_postgresql_13_or_newer_reached_directly_is_served() {
        assert_eq!(postgres(130_000).problem(), None);
        assert_eq!(postgres(170_002).problem(), None);
    }

    #[test]
    fn postgresql_older_than_13_is_refused_naming_the_version_found() {
        let problem = postgres(120_017).problem().expect("refused");
        assert_eq!(
            problem,
            EngineProblem::TooOld {
                version: "PostgreSQL 12.17".into()
            }
        );
        assert!(
            problem
                .to_string()
                .starts_with("PostgreSQL 12.17 is older than PostgreSQL 13")
        );
    }

    #[test]
    fn a_hot_standby_or_read_only_server_is_refused_pointing_at_the_primary() {
        let standby = EngineFacts {
            read_only: true,
            in_recovery: true,
            ..postgres(150_004)
        };
        let message = standby.problem().expect("refused").to_string();
        assert!(message.contains("hot standby"), "{message}");
        assert!(
            message.contains("connect to the primary / writer endpoint"),
            "{message}"
        );
        let read_only = EngineFacts {
            read_only: true,
            ..postgres(150_004)
        };
        let message = read_only.problem().expect("refused").to_string();
        assert!(message.contains("transaction_read_only is on"), "{message}");
    }

    #[test]
    fn a_pooler_sharing_sessions_is_refused_suggesting_session_pooling() {
        let pooled = EngineFacts {
            sessions_shared: true,
            ..postgres(150_004)
        };
        let message = pooled.problem().expect("refused").to_string();
        assert!(
            message.contains("LISTEN/NOTIFY does not round-trip"),
            "{message}"
        );
        assert!(message.contains("use session pooling"), "{message}");
    }

    #[test]
    fn engines_that_only_speak_the_protocol_are_named() {
        let cockroach = EngineFacts {
            version: "CockroachDB CCL v24.1.0 (x86_64-pc-linux-gnu)".into(),
            ..postgres(130_000)
        };
        assert_eq!(
            cockroach.problem(),
            Some(EngineProblem::Unsupported {
                engine: "CockroachDB"
            })
        );
        let yugabyte = EngineFacts {
            version: "PostgreSQL 15.2-YB-2.25.0.0-b0 on x86_64-pc-linux-gnu".into(),
            ..postgres(150_002)
        };
        assert_eq!(
            yugabyte.problem(),
            Some(EngineProblem::Unsupported {
                engine: "YugabyteDB"
            })
        );
    }

    #[test]
    fn an_unparsable_version_text_still_names_the_number() {
        let odd = EngineFacts {
            version: "SomethingDB".into(),
            ..postgres(110_000)
        };
        assert_eq!(
            odd.problem(),
            Some(EngineProblem::TooOld {
                version: "server_version_num 110000".into()
            })
        );
    }
}
