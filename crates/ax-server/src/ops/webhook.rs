//! The alert webhook: one JSON POST per alert to an `http://` or `https://` URL (system
//! root certificates), retried 3 times with backoff; a 2xx answer is success.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use std::time::Duration;

const TRIES: u32 = 3;
const TIMEOUT: Duration = Duration::from_secs(10);

/// POSTs `body` (JSON) to `url`.
pub(crate) async fn post(url: &str, body: Vec<u8>) -> Result<(), String> {
    let mut last = String::new();
    for n in 0..TRIES {
        if n > 0 {
            tokio::time::sleep(Duration::from_secs(1 << n)).await;
        }
        match tokio::time::timeout(TIMEOUT, once(url, Bytes::from(body.clone()))).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last = e,
            Err(_) => last = format!("no answer within {TIMEOUT:?}"),
        }
    }
    Err(last)
}

/// Checks a webhook URL (for a clear error at start rather than at the first alert).
pub(crate) fn check(url: &str) -> Result<(), String> {
    target(url).map(|_| ())
}

fn target(url: &str) -> Result<(http::Uri, bool, String, u16), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("webhook URL {url:?}: {e}"))?;
    let tls = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => return Err(format!("webhook URL {url:?}: only http:// and https://")),
    };
    let host = uri
        .host()
        .ok_or(format!("webhook URL {url:?}: no host"))?
        .to_string();
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    Ok((uri, tls, host, port))
}

async fn once(url: &str, body: Bytes) -> Result<(), String> {
    let (uri, tls, host, port) = target(url)?;
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(|e| format!("connect {host}:{port}: {e}"))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let request = http::Request::post(path)
        .header("host", &host)
        .header("content-type", "application/json")
        .header("user-agent", concat!("ax/", env!("CARGO_PKG_VERSION")))
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let status = if tls {
        let mut roots = tokio_rustls::rustls::RootCertStore::empty();
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        let config = tokio_rustls::rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = tokio_rustls::rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| e.to_string())?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {host}: {e}"))?;
        send(TokioIo::new(stream), request).await?
    } else {
        send(TokioIo::new(tcp), request).await?
    };
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("answered {status}"))
    }
}

async fn send<T>(io: T, request: http::Request<Full<Bytes>>) -> Result<http::StatusCode, String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let _ = response.into_body().collect().await;
    Ok(status)
}
