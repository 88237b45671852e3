//! How the `ax` command reaches NATS. Secrets are read from flags or the environment and
//! never logged.

use anyhow::{bail, Context, Result};
use async_nats::ConnectErrorKind;
use clap::Args;
use rand::Rng;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Args)]
pub(crate) struct Conn {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long,
        global = true,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub(crate) url: String,
    /// Credentials file (JWT + nkey seed).
    #[arg(long, global = true, env = "NATS_CREDS")]
    creds: Option<PathBuf>,
    /// User name (with --password).
    #[arg(long, global = true, env = "NATS_USER")]
    user: Option<String>,
    /// Password (with --user).
    #[arg(long, global = true, env = "NATS_PASSWORD", hide_env_values = true)]
    password: Option<String>,
    /// Token.
    #[arg(long, global = true, env = "NATS_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Nkey seed.
    #[arg(long, global = true, env = "NATS_NKEY", hide_env_values = true)]
    nkey: Option<String>,
    /// CA certificate (PEM) to verify the server's TLS certificate.
    #[arg(long, global = true, env = "NATS_CA")]
    tls_ca: Option<PathBuf>,
    /// Inbox prefix for replies, e.g. `_INBOX.worker-emails` under a least-privilege
    /// config where each user may only subscribe to its own prefix.
    #[arg(long, global = true, env = "NATS_INBOX_PREFIX")]
    inbox_prefix: Option<String>,
}

impl Conn {
    /// The server addresses of `--url`, which may list several, comma-separated.
    fn addrs(&self) -> Result<Vec<async_nats::ServerAddr>> {
        self.url
            .split(',')
            .map(|u| {
                u.trim()
                    .parse::<async_nats::ServerAddr>()
                    .with_context(|| format!("--url: {u:?} is not a NATS URL"))
            })
            .collect()
    }

    async fn options(&self) -> Result<async_nats::ConnectOptions> {
        let mut opts = async_nats::ConnectOptions::new().name("ax");
        if let Some(creds) = &self.creds {
            opts = opts
                .credentials_file(creds)
                .await
                .context("reading creds file")?;
        }
        match (&self.user, &self.password) {
            (Some(u), Some(p)) => opts = opts.user_and_password(u.clone(), p.clone()),
            (None, None) => {}
            _ => bail!("--user and --password go together"),
        }
        if let Some(token) = &self.token {
            opts = opts.token(token.clone());
        }
        if let Some(seed) = &self.nkey {
            opts = opts.nkey(seed.clone());
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some(prefix) = &self.inbox_prefix {
            opts = opts.custom_inbox_prefix(prefix);
        }
        Ok(opts)
    }

    /// Connects once; an unreachable server is an error (one-shot commands).
    pub(crate) async fn connect(&self) -> Result<async_nats::Client> {
        self.options()
            .await?
            .connect(self.addrs()?.as_slice())
            .await
            .with_context(|| format!("connecting to NATS at {}", self.url))
    }

    /// Connects, waiting with backoff while the server cannot be reached (long-running
    /// processes may start before NATS). Refused credentials or TLS fail at once. `None`
    /// if `shutdown` comes first.
    pub(crate) async fn connect_waiting(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Option<async_nats::Client>> {
        let mut pause = Duration::from_millis(100);
        let mut told = false;
        loop {
            match self
                .options()
                .await?
                .connect(self.addrs()?.as_slice())
                .await
            {
                Ok(client) => {
                    if told {
                        tracing::info!(url = %self.url, "connected to NATS");
                    }
                    return Ok(Some(client));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        ConnectErrorKind::Io | ConnectErrorKind::TimedOut | ConnectErrorKind::Dns
                    ) =>
                {
                    if !told {
                        tracing::warn!(url = %self.url, cause = %e, "waiting for NATS; retrying with backoff");
                        told = true;
                    }
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("connecting to NATS at {}", self.url))
                }
            }
            let jittered = pause.mul_f64(1.0 - rand::rng().random_range(0.0..0.2));
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(jittered) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }
}
