//! The Dockerfile, proven without a container engine. Both stages' bases are Debian
//! bookworm, which debootstrap builds from Debian's packages: a minbase root stands for
//! `debian:bookworm-slim`, and that root plus what the rust image adds (gcc, libc6-dev,
//! ca-certificates) for `rust:*-slim-bookworm`. The Dockerfile's own instructions are
//! read from it and carried out in a copy of such a root with chroot, so the test and the
//! image cannot drift apart:
//!
//! - the final stage's RUN lines run, the gateway binary goes where its COPY puts it, and
//!   the image's ENTRYPOINT and CMD serve as its USER with its ENV (plus a database of
//!   the test's own, as deploy/compose.yaml adds) until the HEALTHCHECK's command exits 0;
//! - the build stage's apt lines run, then every tool the C parts of the build call must
//!   be there, and librdkafka's own `./configure` must pass with the flags rdkafka-sys
//!   gives it.
//!
//! The roots are cached under the target directory (debootstrap takes a minute or two,
//! once per machine); each test works in a copy it deletes. It needs root (chroot and a
//! /proc mount), debootstrap (`.ci/run` installs it) and Debian's mirror: without them it
//! fails and says which is missing. The chroot shares the host's network, so the
//! gateway reaches the tests' PostgreSQL at 127.0.0.1, and the image's ports (50051,
//! 9464, 9465) must be free on this machine while the runtime test runs.

use std::{
    fs::File,
    net::{Ipv4Addr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use crate::common::*;
use tokio::process::Command;

/// The Debian release both stages' bases are built on.
const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";
/// The apt sources of the `debian:bookworm-slim` image: security and point-release
/// updates besides the release, so the roots install the packages an image build would.
const IMAGE_APT_SOURCES: &str = "Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
";
/// What the rust slim images install on Debian's slim image (their Dockerfile also
/// installs wget, and removes it again once rustup is fetched).
const RUST_SLIM_PACKAGES: &str = "gcc libc6-dev ca-certificates";
/// The PATH Debian's images set.
const IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Every program the C parts of the gateway's build run, read from their build scripts:
/// cc (through the `cc` crate: mimalloc, ring, libz-sys, openssl-sys) compiles with `cc`
/// and archives with `ar`; openssl-sys and libz-sys ask `pkg-config`; rdkafka-sys copies
/// librdkafka's source with `cp`, runs its mklove `./configure` (a `bash` script, which
/// requires a C++ compiler, `c++`) and `make`. No cmake (rdkafka's `cmake-build` feature
/// is off), perl (OpenSSL is the system's, not vendored), python3 (only librdkafka's
/// shared library's linker script wants it) or curl (its `curl` feature is off).
const BUILD_TOOLS: [&str; 7] = ["cc", "c++", "ar", "make", "bash", "cp", "pkg-config"];
/// The pkg-config packages those build scripts look up: openssl-sys `openssl`, libz-sys
/// `zlib`, librdkafka's configure `libssl`, `libcrypto` and `zlib`.
const BUILD_PKG_CONFIG: [&str; 4] = ["openssl", "libssl", "libcrypto", "zlib"];
/// The rdkafka features of the workspace's Cargo.toml that [`RDKAFKA_CONFIGURE_FLAGS`]
/// follow.
const RDKAFKA_FEATURES: [&str; 3] = ["tokio", "libz", "ssl"];
/// The flags rdkafka-sys's build.rs gives librdkafka's configure with those features:
/// TLS on, zlib on by default, GSSAPI, curl, zstd and the external lz4 off.
const RDKAFKA_CONFIGURE_FLAGS: [&str; 5] = [
    "--enable-ssl",
    "--disable-gssapi",
    "--disable-curl",
    "--disable-zstd",
    "--disable-lz4-ext",
];

const DEBOOTSTRAP_TIME: Duration = Duration::from_secs(900);
const APT_TIME: Duration = Duration::from_secs(600);
const COPY_TIME: Duration = Duration::from_secs(300);
const CONFIGURE_TIME: Duration = Duration::from_secs(180);
const START_TIME: Duration = Duration::from_secs(60);
const STOP_TIME: Duration = Duration::from_secs(30);

#[tokio::test]
async fn the_runtime_stage_serves_as_its_user_and_passes_its_own_healthcheck() {
    let dockerfile = Dockerfile::read();
    let stage = dockerfile.runtime_stage();
    assert_eq!(
        stage.base, "debian:bookworm-slim",
        "this test builds a debian:bookworm-slim root; teach it the new base"
    );
    require_root_and_debootstrap();
    let minbase = minbase_root().await;
    let root = Root::copy_of(&minbase, "runtime").await;
    root.prepare_for_apt();

    let image = root.apply_runtime_stage(stage).await;
    assert_ne!(image.user.uid, 0, "the image runs as a non-root user");
    let binary = root.inside(&image.binary);
    let metadata = std::fs::metadata(&binary).expect("the binary is where COPY put it");
    assert!(std::os::unix::fs::PermissionsExt::mode(&metadata.permissions()) & 0o001 != 0);

    // The chroot shares this machine's network: the image's ports must be free, and two
    // runs of this test (from other checkouts too) take turns.
    let _ports = lock_file(&std::env::temp_dir().join("outbox-gateway-image-ports.lock")).await;
    for port in &image.exposed {
        if let Err(error) = TcpListener::bind((Ipv4Addr::UNSPECIFIED, *port)) {
            panic!("port {port}, which the image exposes, is taken on this machine: {error}");
        }
    }
    let listen: SocketAddr = image
        .env_value("OUTBOX_LISTEN")
        .expect("the image's ENV sets OUTBOX_LISTEN")
        .parse()
        .expect("OUTBOX_LISTEN is an address");
    assert!(listen.ip().is_unspecified(), "{listen}: beyond loopback");
    assert!(
        image.exposed.contains(&listen.port()),
        "{listen} is exposed"
    );

    let database = TestDatabase::create().await;
    // What deploy/compose.yaml adds to the image's environment.
    let deployment = [
        ("DATABASE_URL", database.url()),
        ("OUTBOX_INSECURE_NO_AUTH", "true".to_owned()),
    ];
    let mut environment = image.environment();
    environment.extend(deployment.map(|(key, value)| (key.to_owned(), value)));

    let mut gateway = root
        .command(&image.user, &environment, &image.command())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the image's command");
    let log = ProcessLog::collect(&mut gateway);
    let announced = log.announced("serving gRPC", &mut gateway).await;
    assert_eq!(announced, listen, "it serves where the image's ENV says");
    let local = SocketAddr::from((Ipv4Addr::LOCALHOST, listen.port()));
    outbox_testkit::gateway::wait_until_serving(local, START_TIME, || {
        matches!(gateway.try_wait(), Ok(None))
    })
    .await
    .unwrap_or_else(|error| panic!("{error}; its log:\n{}", log.text()));

    let healthcheck = image
        .healthcheck
        .as_ref()
        .expect("the image has a HEALTHCHECK");
    run(
        &format!("the HEALTHCHECK {:?}", healthcheck.command),
        &mut root.command(&image.user, &environment, &healthcheck.command),
        healthcheck.timeout,
    )
    .await;

    send_signal(&gateway, "TERM");
    let status = tokio::time::timeout(STOP_TIME, gateway.wait()).await;
    assert!(
        matches!(status, Ok(Ok(status)) if status.success()),
        "the gateway stops cleanly on SIGTERM ({status:?}); its log:\n{}",
        log.text()
    );
}

#[tokio::test]
async fn the_build_stage_installs_every_tool_the_c_dependencies_call() {
    let dockerfile = Dockerfile::read();
    let stage = dockerfile.build_stage();
    assert!(
        stage.base.starts_with("rust:") && stage.base.ends_with("-slim-bookworm"),
        "this test builds a rust:*-slim-bookworm root; teach it the new base {}",
        stage.base
    );
    assert_rdkafka_features_are(&RDKAFKA_FEATURES);
    require_root_and_debootstrap();
    let rust_slim = rust_slim_root().await;
    let root = Root::copy_of(&rust_slim, "build").await;
    root.prepare_for_apt();
    let apt_lines = root.apply_build_stage_apt_lines(stage).await;
    assert!(
        apt_lines > 0,
        "the build stage installs packages with apt-get"
    );

    let missing: Vec<&str> = BUILD_TOOLS
        .into_iter()
        .filter(|tool| !root.has_command(tool))
        .collect();
    assert!(
        missing.is_empty(),
        "the build stage lacks {missing:?}, which the C parts of the build run"
    );
    let root_user = User::root();
    let environment = vec![("PATH".to_owned(), IMAGE_PATH.to_owned())];
    let mut pkg_config = vec!["pkg-config".to_owned(), "--print-errors".to_owned()];
    pkg_config.push("--exists".to_owned());
    pkg_config.extend(BUILD_PKG_CONFIG.map(str::to_owned));
    run(
        "pkg-config in the build stage",
        &mut root.command(&root_user, &environment, &pkg_config),
        COPY_TIME,
    )
    .await;

    // librdkafka's configure checks more than the list above (headers, libraries, the
    // C++ compiler); it takes seconds, where `make` would take minutes.
    let source = librdkafka_source();
    copy_tree(&source, &root.inside("/tmp/librdkafka")).await;
    let mut configure = vec!["sh".to_owned(), "-c".to_owned()];
    configure.push(format!(
        "cd /tmp/librdkafka && ./configure {}",
        RDKAFKA_CONFIGURE_FLAGS.join(" ")
    ));
    run(
        "librdkafka's ./configure in the build stage",
        &mut root.command(&root_user, &environment, &configure),
        CONFIGURE_TIME,
    )
    .await;
}

#[test]
fn the_dockerfile_reader_joins_continuations_and_skips_comments() {
    let text = "# a comment\nFROM debian:bookworm-slim AS base\n\nRUN apt-get update \\\n    # inside\n    && true\nENV A=1 \\\n    B=2\nFROM x\nCMD [\"serve\"]\n";
    let dockerfile = Dockerfile::parse(text);
    assert_eq!(dockerfile.stages.len(), 2);
    let first = &dockerfile.stages[0];
    assert_eq!(first.base, "debian:bookworm-slim");
    assert_eq!(first.instructions.len(), 2);
    assert_eq!(first.instructions[0].keyword, "RUN");
    assert_eq!(
        first.instructions[0].arguments,
        "apt-get update     && true"
    );
    assert_eq!(env_pairs(&first.instructions[1].arguments).len(), 2);
    assert_eq!(dockerfile.stages[1].instructions[0].keyword, "CMD");
}

/// The release profile keeps the installed binary small; `profiling` is release with
/// line tables, for profilers and the benchmarks' profiles.
#[test]
fn the_release_profile_carries_no_debug_info_and_profiling_adds_line_tables() {
    let manifest = manifest();
    let profiles = manifest["profile"].as_table().expect("[profile] tables");
    let release = profiles["release"].as_table().expect("[profile.release]");
    assert!(
        matches!(release.get("debug"), Some(toml::Value::Boolean(false))),
        "{release:?}"
    );
    assert!(
        matches!(
            release.get("strip").and_then(toml::Value::as_str),
            Some("debuginfo" | "symbols")
        ),
        "{release:?}"
    );
    let profiling = profiles["profiling"]
        .as_table()
        .expect("[profile.profiling]");
    assert_eq!(
        profiling.get("inherits").and_then(toml::Value::as_str),
        Some("release")
    );
    assert_eq!(
        profiling.get("debug").and_then(toml::Value::as_str),
        Some("line-tables-only")
    );
    assert_eq!(
        profiling.get("strip").and_then(toml::Value::as_str),
        Some("none"),
        "profiling keeps what it asks for"
    );
}

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn manifest() -> toml::Table {
    std::fs::read_to_string(repository().join("Cargo.toml"))
        .expect("read Cargo.toml")
        .parse()
        .expect("Cargo.toml parses")
}

fn assert_rdkafka_features_are(expected: &[&str]) {
    let manifest = manifest();
    let rdkafka = &manifest["workspace"]["dependencies"]["rdkafka"];
    let mut features: Vec<&str> = rdkafka["features"]
        .as_array()
        .expect("rdkafka's features")
        .iter()
        .filter_map(toml::Value::as_str)
        .collect();
    features.sort_unstable();
    let mut expected = expected.to_vec();
    expected.sort_unstable();
    assert_eq!(
        features, expected,
        "RDKAFKA_CONFIGURE_FLAGS follow rdkafka's features: update them together"
    );
    assert_eq!(
        rdkafka
            .get("default-features")
            .and_then(toml::Value::as_bool),
        Some(false)
    );
}

/// librdkafka's source as rdkafka-sys carries it, in cargo's registry: the version of
/// Cargo.lock.
fn librdkafka_source() -> PathBuf {
    let lock: toml::Table = std::fs::read_to_string(repository().join("Cargo.lock"))
        .expect("read Cargo.lock")
        .parse()
        .expect("Cargo.lock parses");
    let version = lock["package"]
        .as_array()
        .expect("Cargo.lock's packages")
        .iter()
        .find(|package| package["name"].as_str() == Some("rdkafka-sys"))
        .and_then(|package| package["version"].as_str())
        .expect("Cargo.lock holds rdkafka-sys")
        .to_owned();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
        .expect("CARGO_HOME or HOME");
    let registries = cargo_home.join("registry/src");
    let found = std::fs::read_dir(&registries)
        .unwrap_or_else(|error| panic!("read {}: {error}", registries.display()))
        .filter_map(Result::ok)
        .map(|registry| {
            registry
                .path()
                .join(format!("rdkafka-sys-{version}/librdkafka"))
        })
        .find(|source| source.join("configure").is_file());
    found.unwrap_or_else(|| {
        panic!(
            "rdkafka-sys {version}'s librdkafka is not under {}",
            registries.display()
        )
    })
}

/// Fails the test, saying what is missing, unless it runs as root with debootstrap.
fn require_root_and_debootstrap() {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let effective_uid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .expect("an effective uid");
    assert_eq!(
        effective_uid, "0",
        "the image test needs root (chroot, mount): run the tests as root, as .ci/run does"
    );
    assert!(
        debootstrap().is_some(),
        "the image test needs debootstrap: `apt-get install debootstrap` (.ci/run installs it)"
    );
}

fn debootstrap() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|directory| directory.join("debootstrap"))
        .find(|candidate| candidate.is_file())
}

fn image_roots() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("image-root")
}

/// Holds an exclusive lock on `path` (created when missing) until dropped.
async fn lock_file(path: &Path) -> File {
    let file = File::create(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    tokio::task::spawn_blocking(move || file.lock().map(|()| file))
        .await
        .expect("lock task")
        .unwrap_or_else(|error| panic!("lock {}: {error}", path.display()))
}

/// The root of `debian:bookworm-slim`: Debian's minbase with the image's apt sources.
async fn minbase_root() -> PathBuf {
    let inputs = format!("{SUITE} {MIRROR} {IMAGE_APT_SOURCES}");
    cached_root("bookworm-minbase", &inputs, |root| async move {
        let debootstrap = debootstrap().expect("debootstrap");
        run(
            "debootstrap (needs Debian's mirror)",
            Command::new(debootstrap)
                .args(["--variant=minbase", SUITE])
                .arg(root.path())
                .arg(MIRROR),
            DEBOOTSTRAP_TIME,
        )
        .await;
        let apt = root.inside("/etc/apt");
        let _ = std::fs::remove_file(apt.join("sources.list"));
        std::fs::write(apt.join("sources.list.d/debian.sources"), IMAGE_APT_SOURCES)
            .expect("write the image's apt sources");
        root
    })
    .await
}

/// The root of `rust:*-slim-bookworm` without rust: minbase plus what that image
/// installs, with apt's lists removed as it does.
async fn rust_slim_root() -> PathBuf {
    let minbase = minbase_root().await;
    // The rust images clean apt's lists and downloaded packages as they go.
    let script = format!(
        "apt-get update && apt-get install -y --no-install-recommends {RUST_SLIM_PACKAGES} \
         && apt-get clean && rm -rf /var/lib/apt/lists/*"
    );
    let inputs = format!("{} {script}", minbase.display());
    cached_root("bookworm-rust-slim", &inputs, |root| async move {
        copy_tree(&minbase, root.path()).await;
        root.prepare_for_apt();
        root.run_shell(&User::root(), &[], &script).await;
        root
    })
    .await
}

/// The root `name` under the target directory, built by `build` into a fresh directory
/// the first time and renamed into place, so a run cut off half-way leaves nothing a
/// later run would take for a finished root. Its directory's name carries a hash of
/// `inputs` (what the build depends on), so changing them builds another. A lock keeps
/// concurrent tests (and test processes) from building it twice.
async fn cached_root<F, Fut>(name: &str, inputs: &str, build: F) -> PathBuf
where
    F: FnOnce(Root) -> Fut,
    Fut: std::future::Future<Output = Root>,
{
    let roots = image_roots();
    std::fs::create_dir_all(&roots).expect("create the image roots' directory");
    let name = format!("{name}-{:016x}", {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        inputs.hash(&mut hasher);
        hasher.finish()
    });
    let _lock = lock_file(&roots.join(format!("{name}.lock"))).await;
    let finished = roots.join(&name);
    if finished.is_dir() {
        return finished;
    }
    // Only the lock's holder builds here: what is left is an earlier run's, cut off.
    let building = roots.join(format!("{name}.partial"));
    remove_root(&building);
    std::fs::create_dir(&building).expect("create the root being built");
    let built = build(Root::new(building.clone())).await.keep();
    std::fs::rename(&built, &finished).expect("move the built root into place");
    finished
}

/// `cp -a`: device nodes, owners and modes as they are; `to` is created when missing
/// and filled when it exists.
async fn copy_tree(from: &Path, to: &Path) {
    run(
        &format!("cp -a {}/. {}", from.display(), to.display()),
        Command::new("cp").arg("-a").arg(from.join(".")).arg(to),
        COPY_TIME,
    )
    .await;
}

/// A user of the image as Docker resolves USER: by name or uid in the root's
/// /etc/passwd, giving the primary group and home; an unknown uid gets group 0 and `/`.
#[derive(Debug, Clone)]
struct User {
    uid: u32,
    gid: u32,
    home: String,
}

impl User {
    fn root() -> User {
        User {
            uid: 0,
            gid: 0,
            home: "/root".into(),
        }
    }
}

/// A copy of a cached root for one test, with /proc mounted while it is in use. Dropped,
/// it unmounts what is mounted in it and deletes it, never with a mount left inside.
struct Root {
    path: PathBuf,
    keep: bool,
}

impl Root {
    fn new(path: PathBuf) -> Root {
        Root { path, keep: false }
    }

    async fn copy_of(cached: &Path, purpose: &str) -> Root {
        let runs = image_roots().join("runs");
        std::fs::create_dir_all(&runs).expect("create the runs' directory");
        let path = runs.join(format!("{purpose}-{}", uuid::Uuid::new_v4().simple()));
        let root = Root::new(path);
        copy_tree(cached, &root.path).await;
        root
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// `absolute`, a path inside the image, as a path on this machine.
    fn inside(&self, absolute: &str) -> PathBuf {
        self.path.join(absolute.trim_start_matches('/'))
    }

    /// What apt needs inside a chroot: /proc, and the host's resolver as Docker gives a
    /// container.
    fn prepare_for_apt(&self) {
        std::fs::copy("/etc/resolv.conf", self.inside("/etc/resolv.conf"))
            .expect("copy /etc/resolv.conf into the root");
        let status = std::process::Command::new("mount")
            .args(["-t", "proc", "proc"])
            .arg(self.inside("/proc"))
            .status()
            .expect("run mount");
        assert!(status.success(), "mount /proc in the root (needs root)");
    }

    /// Unmounts what is mounted in the root and keeps its files.
    fn keep(mut self) -> PathBuf {
        unmount_all_under(&self.path);
        self.keep = true;
        self.path.clone()
    }

    /// `argv` run in the root as `user` with exactly `environment`.
    fn command(&self, user: &User, environment: &[(String, String)], argv: &[String]) -> Command {
        let mut command = Command::new("chroot");
        command
            .arg(format!("--userspec={}:{}", user.uid, user.gid))
            .arg(&self.path)
            .args(["env", "-i"])
            .args(
                environment
                    .iter()
                    .map(|(key, value)| format!("{key}={value}")),
            )
            .args(argv)
            .current_dir(&self.path)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// A RUN line in shell form: `/bin/sh -c`, as `user`, with the PATH Debian's images
    /// set and the ENV so far.
    async fn run_shell(&self, user: &User, env: &[(String, String)], script: &str) {
        let mut environment = vec![
            ("PATH".to_owned(), IMAGE_PATH.to_owned()),
            ("HOME".to_owned(), user.home.clone()),
        ];
        environment.extend_from_slice(env);
        let argv = ["/bin/sh".to_owned(), "-c".to_owned(), script.to_owned()];
        run(
            &format!("RUN {script}"),
            &mut self.command(user, &environment, &argv),
            APT_TIME,
        )
        .await;
    }

    fn has_command(&self, tool: &str) -> bool {
        let probe = format!("command -v {tool}");
        std::process::Command::new("chroot")
            .arg(&self.path)
            .args([
                "env",
                "-i",
                &format!("PATH={IMAGE_PATH}"),
                "sh",
                "-c",
                &probe,
            ])
            .stdout(Stdio::null())
            .status()
            .expect("run chroot")
            .success()
    }

    fn user(&self, spec: &str) -> User {
        let passwd = std::fs::read_to_string(self.inside("/etc/passwd")).expect("read passwd");
        let (name, group) = match spec.split_once(':') {
            Some((name, group)) => (name, Some(group)),
            None => (spec, None),
        };
        let entry = passwd
            .lines()
            .map(|line| line.split(':').collect::<Vec<_>>())
            .find(|fields| fields.len() >= 6 && (fields[0] == name || fields[2] == name));
        let mut user = match entry {
            Some(fields) => User {
                uid: fields[2].parse().expect("a uid"),
                gid: fields[3].parse().expect("a gid"),
                home: fields[5].to_owned(),
            },
            None => User {
                uid: name
                    .parse()
                    .unwrap_or_else(|_| panic!("no user {name} in the image")),
                gid: 0,
                home: "/".into(),
            },
        };
        if let Some(group) = group {
            user.gid = group.parse().expect("USER's group as a number");
        }
        user
    }

    /// Carries out the final stage's instructions in this root, in order; returns what
    /// the image runs with.
    async fn apply_runtime_stage(&self, stage: &Stage) -> Image {
        let mut image = Image {
            user: User::root(),
            env: Vec::new(),
            binary: String::new(),
            exposed: Vec::new(),
            healthcheck: None,
            entrypoint: Vec::new(),
            cmd: Vec::new(),
        };
        for instruction in &stage.instructions {
            let arguments = instruction.arguments.as_str();
            match instruction.keyword.as_str() {
                "RUN" => self.run_shell(&image.user, &image.env, arguments).await,
                "COPY" => image.binary = self.copy_gateway(arguments),
                "USER" => image.user = self.user(arguments),
                "ENV" => image.env.extend(env_pairs(arguments)),
                "EXPOSE" => image.exposed.extend(
                    arguments
                        .split_whitespace()
                        .map(|port| port.parse::<u16>().expect("EXPOSE takes TCP ports")),
                ),
                "HEALTHCHECK" => image.healthcheck = Some(Healthcheck::parse(arguments)),
                "ENTRYPOINT" => image.entrypoint = exec_form(arguments),
                "CMD" => image.cmd = exec_form(arguments),
                other => panic!("the image test does not carry out {other} yet: teach it"),
            }
        }
        assert!(
            !image.binary.is_empty(),
            "the final stage copies the gateway in"
        );
        image
    }

    /// The final stage's COPY of the release binary: the binary this test was built
    /// with goes there (a debug build links the same libraries).
    fn copy_gateway(&self, arguments: &str) -> String {
        let words: Vec<&str> = arguments.split_whitespace().collect();
        let [from, source, destination] = words[..] else {
            panic!("the image test knows COPY --from=build <binary> <path>, not {arguments}");
        };
        assert_eq!(from, "--from=build", "COPY {arguments}");
        assert!(source.ends_with("/outbox-gateway"), "COPY {arguments}");
        let destination = match destination.strip_suffix('/') {
            Some(directory) => format!("{directory}/outbox-gateway"),
            None => destination.to_owned(),
        };
        let target = self.inside(&destination);
        std::fs::create_dir_all(target.parent().expect("a directory"))
            .expect("create COPY's directory");
        std::fs::copy(env!("CARGO_BIN_EXE_outbox-gateway"), &target)
            .expect("copy the gateway binary into the root");
        destination
    }

    /// Runs the build stage's RUN lines that call apt-get (the others build with cargo,
    /// which this root lacks); returns how many ran.
    async fn apply_build_stage_apt_lines(&self, stage: &Stage) -> usize {
        let mut env = Vec::new();
        let mut ran = 0;
        for instruction in &stage.instructions {
            match instruction.keyword.as_str() {
                "ENV" => env.extend(env_pairs(&instruction.arguments)),
                "RUN" if instruction.arguments.contains("apt-get") => {
                    self.run_shell(&User::root(), &env, &instruction.arguments)
                        .await;
                    ran += 1;
                }
                _ => {}
            }
        }
        ran
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        remove_root(&self.path);
    }
}

/// Unmounts everything mounted at or under `root`, deepest first; lazily when busy (a
/// process killed a moment ago may still hold /proc).
fn unmount_all_under(root: &Path) {
    let mut mounts = mounts_under(root);
    mounts.sort_by_key(|mount| std::cmp::Reverse(mount.as_os_str().len()));
    for mount in mounts {
        let unmounted = std::process::Command::new("umount")
            .arg(&mount)
            .status()
            .is_ok_and(|status| status.success());
        if !unmounted {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&mount)
                .status();
        }
    }
}

/// Deletes `root` once nothing is mounted in it; with a mount left, it stays (deleting
/// through a mount would delete what is mounted) and says so.
fn remove_root(root: &Path) {
    if !root.exists() {
        return;
    }
    unmount_all_under(root);
    let left = mounts_under(root);
    if !left.is_empty() {
        eprintln!(
            "left {} in place: {left:?} still mounted in it",
            root.display()
        );
        return;
    }
    if let Err(error) = std::fs::remove_dir_all(root) {
        eprintln!("cannot delete {}: {error}", root.display());
    }
}

fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| line.split_whitespace().nth(1))
        .map(|mount_point| PathBuf::from(mount_point.replace("\\040", " ")))
        .filter(|mount_point| mount_point.starts_with(root))
        .collect()
}

/// What the final stage says the image runs with.
struct Image {
    user: User,
    env: Vec<(String, String)>,
    /// Where COPY put the gateway binary, inside the image.
    binary: String,
    exposed: Vec<u16>,
    healthcheck: Option<Healthcheck>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
}

impl Image {
    /// The environment a container of the image starts with, as Docker sets it.
    fn environment(&self) -> Vec<(String, String)> {
        let mut environment = vec![
            ("PATH".to_owned(), IMAGE_PATH.to_owned()),
            ("HOME".to_owned(), self.user.home.clone()),
        ];
        environment.extend(self.env.iter().cloned());
        environment
    }

    fn env_value(&self, key: &str) -> Option<&str> {
        (self.env.iter().rev())
            .find(|(name, _)| name == key)
            .map(|(_, value)| value.as_str())
    }

    /// ENTRYPOINT followed by CMD, what `docker run` runs with no arguments.
    fn command(&self) -> Vec<String> {
        self.entrypoint.iter().chain(&self.cmd).cloned().collect()
    }
}

struct Healthcheck {
    timeout: Duration,
    command: Vec<String>,
}

impl Healthcheck {
    /// `[--option=value ...] CMD ["program", ...]`.
    fn parse(arguments: &str) -> Healthcheck {
        let (options, command) = arguments
            .split_once("CMD ")
            .unwrap_or_else(|| panic!("HEALTHCHECK {arguments}: no CMD"));
        let timeout = options
            .split_whitespace()
            .find_map(|option| option.strip_prefix("--timeout="))
            .map_or(Duration::from_secs(30), |timeout| {
                humantime::parse_duration(timeout).expect("HEALTHCHECK's --timeout")
            });
        Healthcheck {
            timeout,
            command: exec_form(command),
        }
    }
}

/// An instruction's JSON array (exec form); the shell form is not what the image uses.
fn exec_form(arguments: &str) -> Vec<String> {
    serde_json::from_str(arguments.trim())
        .unwrap_or_else(|error| panic!("{arguments}: not an exec-form JSON array: {error}"))
}

/// `KEY=value KEY2=value2`: ENV's form without quotes, the one the Dockerfile uses.
fn env_pairs(arguments: &str) -> Vec<(String, String)> {
    arguments
        .split_whitespace()
        .map(|pair| {
            assert!(
                !pair.contains(['"', '\'']),
                "the image test reads ENV values without quotes: {pair}"
            );
            let (key, value) = pair
                .split_once('=')
                .unwrap_or_else(|| panic!("ENV {pair}: the image test reads KEY=value"));
            (key.to_owned(), value.to_owned())
        })
        .collect()
}

/// The Dockerfile as stages of instructions.
struct Dockerfile {
    stages: Vec<Stage>,
}

struct Stage {
    base: String,
    instructions: Vec<Instruction>,
}

struct Instruction {
    /// In capitals.
    keyword: String,
    /// The rest of the logical line, continuations joined.
    arguments: String,
}

impl Dockerfile {
    fn read() -> Dockerfile {
        let text =
            std::fs::read_to_string(repository().join("Dockerfile")).expect("read Dockerfile");
        Dockerfile::parse(&text)
    }

    /// Docker's reading: comment lines are dropped (inside a continuation too), and a
    /// line ending in a backslash continues on the next.
    fn parse(text: &str) -> Dockerfile {
        let mut stages: Vec<Stage> = Vec::new();
        let mut logical = String::new();
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            if let Some(head) = line.trim_end().strip_suffix('\\') {
                logical.push_str(head);
                continue;
            }
            logical.push_str(line);
            let complete = std::mem::take(&mut logical);
            let (keyword, arguments) = complete
                .trim()
                .split_once(char::is_whitespace)
                .unwrap_or_else(|| panic!("Dockerfile: {complete}"));
            let keyword = keyword.to_ascii_uppercase();
            let arguments = arguments.trim().to_owned();
            if keyword == "FROM" {
                let base = arguments.split_whitespace().next().expect("FROM's image");
                stages.push(Stage {
                    base: base.to_owned(),
                    instructions: Vec::new(),
                });
                continue;
            }
            let stage = stages.last_mut().expect("FROM comes first");
            stage.instructions.push(Instruction { keyword, arguments });
        }
        assert!(logical.is_empty(), "the Dockerfile ends in a continuation");
        Dockerfile { stages }
    }

    fn build_stage(&self) -> &Stage {
        assert_eq!(self.stages.len(), 2, "a build stage and the image");
        &self.stages[0]
    }

    fn runtime_stage(&self) -> &Stage {
        self.stages.last().expect("a stage")
    }
}
