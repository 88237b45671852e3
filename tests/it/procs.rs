//! Helpers for tests that run `ax` as real child processes.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub use ax_testkit::net::{free_port, scrape, wait_ready};

/// An `ax` child process, killed on drop.
pub struct AxProc(pub Child);

impl AxProc {
    pub fn spawn(url: &str, args: &[&str]) -> AxProc {
        Self::spawn_with_metrics(url, args, "off")
    }

    pub fn spawn_with_metrics(url: &str, args: &[&str], metrics: &str) -> AxProc {
        Self::spawn_full(url, args, metrics, &[])
    }

    /// With extra environment variables (e.g. an `AX_TEST_*` fault).
    pub fn spawn_env(url: &str, args: &[&str], env: &[(&str, &str)]) -> AxProc {
        Self::spawn_full(url, args, "off", env)
    }

    pub fn spawn_full(url: &str, args: &[&str], metrics: &str, env: &[(&str, &str)]) -> AxProc {
        let child = Command::new(env!("CARGO_BIN_EXE_ax"))
            .args(args)
            .args(["--metrics-addr", metrics])
            .env("NATS_URL", url)
            // AX_PROC_LOG sets the children's log filter (default `warn`), e.g.
            // `warn,ax_server::schedule=debug` to read a campaign failure's path.
            .env(
                "RUST_LOG",
                std::env::var("AX_PROC_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ax");
        AxProc(child)
    }

    /// Waits up to `timeout` for the process to exit on its own; its status if it did.
    pub async fn exited_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.0.try_wait().unwrap() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.0.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    pub fn kill9(&mut self) {
        self.signal("-KILL");
        let _ = self.0.wait();
    }
}

impl Drop for AxProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
