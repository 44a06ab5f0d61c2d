//! `sqlx::migrate!` embeds migrations/ at compile time; a new or changed migration must
//! rebuild the gateway.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
