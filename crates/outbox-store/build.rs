//! `sqlx::migrate!` embeds the top-level migrations/ at compile time; a new or changed
//! migration must rebuild the store.

fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
