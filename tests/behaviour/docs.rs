//! The crates' own documentation against their features: every database and broker a crate
//! has a feature for is named in its crate docs, so that adding one (as MySQL and NATS were)
//! cannot leave the docs speaking of the others only.

use std::path::Path;

/// What a feature's name stands for, as the docs write it.
const NAMED: &[(&str, &str)] = &[
    ("postgres", "PostgreSQL"),
    ("sqlite", "SQLite"),
    ("mysql", "MariaDB"),
    ("rabbitmq", "RabbitMQ"),
    ("redis", "Redis"),
    ("nats", "NATS"),
];

/// The features of the crate at `dir` (the names in its `[features]` table).
fn features(dir: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).expect("the crate's manifest");
    manifest
        .lines()
        .skip_while(|line| line.trim() != "[features]")
        .skip(1)
        .take_while(|line| !line.starts_with('['))
        .filter_map(|line| line.split_once('=').map(|(name, _)| name.trim().to_owned()))
        .collect()
}

/// The crate docs (`//!` lines) of the crate at `dir`.
fn crate_docs(dir: &Path) -> String {
    let lib = std::fs::read_to_string(dir.join("src/lib.rs")).expect("the crate's lib.rs");
    lib.lines()
        .filter_map(|line| line.trim_start().strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn each_library_crate_names_in_its_docs_every_database_and_broker_it_has_a_feature_for() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // idem-macros's database features are set by idem-runtime's, not chosen by users.
    for krate in ["idem-runtime", "idem-events"] {
        let dir = workspace.join(krate);
        let (features, docs) = (features(&dir), crate_docs(&dir));
        let missing: Vec<_> = NAMED
            .iter()
            .filter(|(feature, name)| features.iter().any(|f| f == feature) && !docs.contains(name))
            .map(|(feature, name)| format!("{name} (feature `{feature}`)"))
            .collect();
        assert!(
            missing.is_empty(),
            "{krate}'s crate docs do not name {}",
            missing.join(", ")
        );
    }
}

/// The guide's "Your first tonic service" shows each file of `examples/first-tonic-service` as
/// it is (the manifest with idem as a `git` dependency instead of the repository's path), so
/// that the page a newcomer follows is the code the suite builds and runs.
#[test]
fn the_first_tonic_service_page_shows_each_file_of_the_service_as_it_is() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(workspace.join("docs/guide/grpc-first-service.md"))
        .expect("the page");
    let service = workspace.join("examples/first-tonic-service");
    for file in [
        "Cargo.toml",
        "build.rs",
        "proto/bank/v1/transfers.proto",
        "src/main.rs",
        "tests/replay.rs",
    ] {
        let text = std::fs::read_to_string(service.join(file)).expect("the service's file");
        let shown = text.replace(
            r#"idem-runtime = { path = "../../idem-runtime","#,
            r#"idem-runtime = { git = "https://github.com/idem-rs/idem","#,
        );
        assert!(
            page.contains(&format!("\n{shown}```")),
            "docs/guide/grpc-first-service.md does not show {file} as it is: copy it into the page"
        );
    }
}
