//! A PostgreSQL cluster of the test's own (initdb into a temp folder, on a
//! free port), so that a test can stop, crash and restart the database without
//! disturbing the shared server the other tests use.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tempfile::TempDir;

use super::process::free_port;

pub struct Cluster {
    bin: PathBuf,
    dir: TempDir,
    pub port: u16,
}

/// The newest PostgreSQL server binaries on the machine (PG_BINDIR overrides).
fn bindir() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BINDIR") {
        return dir.into();
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql (or set PG_BINDIR)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("an initdb under /usr/lib/postgresql/*/bin")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl Cluster {
    /// initdb and start. PostgreSQL refuses to run as root, so as root the
    /// cluster belongs to and runs as the `postgres` user.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        if is_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(status.success());
        }
        let cluster = Self {
            bin: bindir(),
            dir,
            port: free_port(),
        };
        let data = cluster.data();
        cluster.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        cluster.pg_ctl_start();
        cluster
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("pgdata")
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A PostgreSQL tool, run as the cluster's owner.
    fn command(&self, tool: &str) -> Command {
        let program = self.bin.join(tool);
        let mut command = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&program);
            c
        } else {
            Command::new(&program)
        };
        command.current_dir(self.dir.path()).stdin(Stdio::null());
        command
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let output = self.command(tool).args(args).output().unwrap();
        assert!(
            output.status.success(),
            "{tool} {args:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn pg_ctl_start(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            self.dir.path().display()
        );
        let data = self.data();
        let log = self.dir.path().join("postgres.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
            ],
        );
    }

    /// Starts the stopped cluster again on the same port.
    pub fn restart(&self) {
        self.pg_ctl_start();
    }

    /// Stops the cluster. `immediate` is a crash: no checkpoint, recovery from
    /// the WAL at the next start.
    pub fn stop(&self, immediate: bool) {
        let data = self.data();
        let mode = if immediate { "immediate" } else { "fast" };
        self.run(
            "pg_ctl",
            &["-D", data.to_str().unwrap(), "-m", mode, "-w", "stop"],
        );
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self
            .command("pg_ctl")
            .args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
