//! A headless Chromium driven over WebDriver (Debian's `chromium` and `chromium-driver`;
//! `./dev test` installs them when missing), and the guard that ends it: whatever
//! starts a browser owns it and ends it on every path (pass, fail, panic, timeout).

use crate::procs::free_port;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// One HTTP request (a fresh connection each time); answers the status and the body.
pub async fn http(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Value) {
    let uri: http::Uri = url.parse().unwrap();
    let addr = format!("{}:{}", uri.host().unwrap(), uri.port_u16().unwrap());
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header("host", &addr)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let body = body.map_or(Bytes::new(), |b| Bytes::from(b.to_string()));
    let resp = sender
        .send_request(req.body(Full::new(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A chromedriver process and one headless browser session.
pub struct Browser {
    driver: tokio::process::Child,
    base: String,
    /// Chromium's profile: its path in a process's command line marks the processes of
    /// this browser.
    profile: tempfile::TempDir,
}

fn driver_binary() -> String {
    for c in ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"] {
        if std::path::Path::new(c).exists() {
            return c.to_string();
        }
    }
    panic!(
        "chromedriver not found: install Debian's chromium and chromium-driver (./dev test does)"
    );
}

impl Browser {
    pub async fn start() -> Browser {
        let port = free_port();
        let driver = tokio::process::Command::new(driver_binary())
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            // Its own process group: the guard ends chromedriver and every browser
            // process it started together.
            .process_group(0)
            .spawn()
            .expect("chromedriver starts");
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        loop {
            let up = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok();
            if up
                && http("GET", &format!("{url}/status"), &[], None).await.1["value"]["ready"]
                    == true
            {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--window-size=1280,900",
                "--disable-background-networking", "--disable-component-update",
                "--no-first-run", "--disable-sync",
                format!("--user-data-dir={}", profile.path().display())]}
        }}});
        let (status, session) = http("POST", &format!("{url}/session"), &[], Some(caps)).await;
        assert_eq!(status, 200, "a browser session: {session}");
        let id = session["value"]["sessionId"].as_str().unwrap();
        Browser {
            driver,
            base: format!("{url}/session/{id}"),
            profile,
        }
    }

    pub async fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, v) = http(method, &format!("{}{path}", self.base), &[], body).await;
        assert_eq!(status, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    pub async fn go(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url }))).await;
    }

    /// The first element matching `css`, waiting up to 15 s for it.
    pub async fn find(&self, css: &str) -> String {
        let started = Instant::now();
        loop {
            let (status, v) = http(
                "POST",
                &format!("{}/element", self.base),
                &[],
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
            if status == 200 {
                return v["value"]
                    .as_object()
                    .and_then(|o| o.values().next())
                    .and_then(Value::as_str)
                    .unwrap()
                    .to_string();
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "no element {css}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs an element command, finding the element again if the page re-rendered it
    /// meanwhile (live updates redraw the view).
    pub async fn on_element(&self, css: &str, what: &str, body: Value) {
        let started = Instant::now();
        loop {
            let e = self.find(css).await;
            let url = format!("{}/element/{e}/{what}", self.base);
            let (status, v) = http("POST", &url, &[], Some(body.clone())).await;
            if status == 200 {
                return;
            }
            assert!(
                v["value"]["error"] == "stale element reference"
                    && started.elapsed() < Duration::from_secs(15),
                "{what} {css}: {v}"
            );
        }
    }

    pub async fn click(&self, css: &str) {
        self.on_element(css, "click", json!({})).await;
    }

    pub async fn type_in(&self, css: &str, text: &str) {
        self.on_element(css, "value", json!({ "text": text })).await;
    }

    pub async fn script(&self, js: &str) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({"script": js, "args": []})),
        )
        .await
    }

    /// Waits (up to `secs`) until the script returns true.
    pub async fn until(&self, what: &str, secs: u64, js: &str) {
        let started = Instant::now();
        while self.script(js).await != Value::Bool(true) {
            assert!(
                started.elapsed() < Duration::from_secs(secs),
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Opens the console and logs in with the admin token.
    pub async fn login(&self, site: &str) {
        self.go(site).await;
        self.type_in("#token", "s3cret-admin").await;
        self.click("#login button").await;
        self.until(
            "the overview",
            15,
            "return document.querySelector('h1')?.textContent === 'Overview'",
        )
        .await;
    }

    pub async fn screenshot(&self, name: &str) {
        if std::env::var("AX_SCREENSHOTS").is_err() {
            return;
        }
        use base64::Engine;
        let png = self.cmd("GET", "/screenshot", None).await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap();
        let path = format!("{}/docs/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::write(path, bytes).unwrap();
    }
}

/// The processes whose command line names `marker`.
fn processes_naming(marker: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .collect()
}

fn kill(target: &str) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", target])
        .stderr(std::process::Stdio::null())
        .status();
}

impl Browser {
    /// Ends the browser and checks that none of its processes is left.
    pub async fn close(mut self) {
        let _ = http("DELETE", &self.base, &[], None).await;
        self.kill_all();
        let marker = self.profile.path().display().to_string();
        let started = Instant::now();
        loop {
            let left = processes_naming(&marker);
            if left.is_empty() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "browser processes left running: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills chromedriver's process group and any process still naming this browser's
    /// profile (a browser that left the group).
    fn kill_all(&mut self) {
        if let Some(pid) = self.driver.id() {
            kill(&format!("-{pid}"));
        }
        let _ = self.driver.start_kill();
        let _ = self.driver.try_wait();
        for pid in processes_naming(&self.profile.path().display().to_string()) {
            kill(&pid.to_string());
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.kill_all();
    }
}
