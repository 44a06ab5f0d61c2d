//! The configuration reference lists exactly the settings `serve` accepts.

use clap::{Args, Command};
use outbox_gateway::config::Settings;

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
