//! The configuration reference lists exactly the settings `serve` accepts, and the
//! defaults that `serve --help` and the reference state are the ones serve uses.

use clap::{Arg, Args, Command, FromArgMatches};
use outbox_gateway::config::{Config, MigrateSettings, Settings};

/// The `[default: ...]` a setting's help ends with, as `--help` prints it.
fn stated_default(argument: &Arg) -> Option<String> {
    let help = argument
        .get_long_help()
        .or(argument.get_help())?
        .to_string();
    let (_, rest) = help.split_once("[default: ")?;
    Some(rest.split_once(']')?.0.to_owned())
}

/// `serve`'s settings as clap sees them, reading no environment variable: one set where
/// the test runs must not stand in for a flag left out.
fn serve_command() -> Command {
    Settings::augment_args(Command::new("serve"))
        .no_binary_name(true)
        .mut_args(|argument| argument.env(None))
}

/// Settings that take a value but have none unless given.
const WITHOUT_DEFAULT: [&str; 7] = [
    "config",
    // Found at start, where the machine keeps such things.
    "data-dir",
    "postgres-bin",
    "tls-cert",
    "tls-key",
    "tls-client-ca",
    "console-allowed-hosts",
];

#[test]
fn the_help_states_the_defaults_serve_uses() {
    let defaults = format!("{:#?}", Config::default());
    let mut checked = 0;
    for argument in serve_command().get_arguments() {
        let flag = argument.get_long().expect("every setting has a flag");
        let is_switch = argument
            .get_num_args()
            .is_some_and(|values| values.min_values() == 0);
        let Some(stated) = stated_default(argument) else {
            assert!(
                is_switch || WITHOUT_DEFAULT.contains(&flag),
                "--{flag} takes a value, but its help states no [default: ...]"
            );
            continue;
        };
        assert!(!is_switch, "--{flag} is a switch: it is off unless given");
        if stated == "off" {
            // Off: as good as not given; a value of its own would not parse.
            assert_eq!(flag, "max-retention", "--{flag} says it is off by default");
            assert_eq!(Config::default().maintenance.max_retention, None);
            continue;
        }
        let matches = serve_command()
            .try_get_matches_from([format!("--{flag}"), stated.clone()])
            .unwrap_or_else(|error| panic!("--{flag}: its stated default does not parse: {error}"));
        let settings = Settings::from_arg_matches(&matches).unwrap();
        let mut configured = Config::from_settings(settings)
            .unwrap_or_else(|error| panic!("--{flag}: its stated default is refused: {error}"));
        if flag == "database-url" {
            // Given, even as the default's value, a URL rules the private cluster out.
            assert!(configured.database_url_given);
            configured.database_url_given = false;
        }
        assert_eq!(
            format!("{configured:#?}"),
            defaults,
            "--{flag}: the help says [default: {stated}], but serve's default is another"
        );
        checked += 1;
    }
    assert!(checked > 30, "only {checked} stated defaults were found");
}

#[test]
fn migrate_states_the_same_defaults_as_serve() {
    let serve = serve_command();
    let migrate = MigrateSettings::augment_args(Command::new("migrate"));
    for argument in migrate.get_arguments() {
        let flag = argument.get_long().expect("every setting has a flag");
        let serve_argument = serve
            .get_arguments()
            .find(|serve_argument| serve_argument.get_long() == Some(flag))
            .unwrap_or_else(|| panic!("--{flag} of migrate is no setting of serve"));
        assert_eq!(
            stated_default(argument),
            stated_default(serve_argument),
            "--{flag}: migrate and serve state different defaults"
        );
    }
}

#[test]
fn the_reference_documents_every_setting_and_nothing_else() {
    let reference = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    let command = Settings::augment_args(Command::new("serve"));
    let mut documented_rows = 0;
    for argument in command.get_arguments() {
        let flag = format!(
            "`--{}`",
            argument.get_long().expect("every setting has a flag")
        );
        let env = format!(
            "`{}`",
            argument
                .get_env()
                .expect("every setting has an env var")
                .to_str()
                .unwrap()
        );
        let row = reference
            .lines()
            .find(|line| line.starts_with(&format!("| {flag} ")))
            .unwrap_or_else(|| panic!("{flag} is not in docs/configuration.md"));
        assert!(
            row.contains(&env),
            "{flag}: the reference does not name {env}"
        );
        if let Some(stated) = stated_default(argument) {
            let documented = row.split('|').nth(4).unwrap_or_default().trim();
            assert!(
                documented == stated || documented == format!("`{stated}`"),
                "{flag}: the reference says the default is {documented}, the help {stated}"
            );
        }
        documented_rows += 1;
    }
    let rows = reference
        .lines()
        .filter(|line| line.starts_with("| `--"))
        .count();
    assert_eq!(
        rows, documented_rows,
        "the reference documents a setting serve does not have"
    );
}
