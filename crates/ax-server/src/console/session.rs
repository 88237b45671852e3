//! Login sessions and login throttling.
//!
//! Logging in with a token makes a session: 256 random bits in an `HttpOnly`,
//! `SameSite=Strict` cookie with a lifetime (`Secure` behind TLS), held in this server's
//! memory. The cookie is never the token: a cookie that leaks (cookies are shared by every
//! port of a host) gives a session that expires and that logging out ends, not the token.
//! Tokens are compared in constant time. Failed logins are throttled per client address
//! and in all.

use super::config::Role;
use base64::Engine;
use cookie::{Cookie, SameSite};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;

/// Most sessions held; the oldest go first past it.
const MAX_SESSIONS: usize = 10_000;
/// Failed logins from one address before it must wait.
const FREE_FAILURES: u32 = 5;
/// Longest wait after failures.
const MAX_PENALTY: Duration = Duration::from_secs(60);
/// Failed logins per second, all addresses together.
const GLOBAL_FAILURES_PER_SEC: u32 = 20;

struct Session {
    role: Role,
    expires: Instant,
}

#[derive(Default)]
struct Failures {
    count: u32,
    until: Option<Instant>,
}

pub(crate) struct Sessions {
    cookie_name: String,
    ttl: Duration,
    live: Mutex<HashMap<String, Session>>,
    failures: Mutex<(HashMap<IpAddr, Failures>, Instant, u32)>,
}

/// True if `given` is `token`, in time independent of where they differ.
pub(crate) fn same(given: &str, token: &str) -> bool {
    given.as_bytes().ct_eq(token.as_bytes()).into()
}

impl Sessions {
    /// Sessions of the console on `port` (the cookie's name carries the port: two consoles
    /// on one host keep their own).
    pub(crate) fn new(port: u16, ttl: Duration) -> Sessions {
        Sessions {
            cookie_name: format!("ax_session_{port}"),
            ttl,
            live: Mutex::default(),
            failures: Mutex::new((HashMap::new(), Instant::now(), 0)),
        }
    }

    /// Starts a session; answers its `Set-Cookie` value.
    pub(crate) fn start(&self, role: Role, secure: bool) -> String {
        let mut bytes = [0u8; 32];
        rand::fill(&mut bytes);
        let id = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let now = Instant::now();
        {
            let mut live = self.live.lock().expect("not poisoned");
            live.retain(|_, s| s.expires > now);
            if live.len() >= MAX_SESSIONS {
                let oldest = live
                    .iter()
                    .min_by_key(|(_, s)| s.expires)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    live.remove(&k);
                }
            }
            live.insert(
                id.clone(),
                Session {
                    role,
                    expires: now + self.ttl,
                },
            );
        }
        self.cookie(id, self.ttl, secure)
    }

    fn cookie(&self, value: String, ttl: Duration, secure: bool) -> String {
        Cookie::build((self.cookie_name.clone(), value))
            .path("/")
            .http_only(true)
            .same_site(SameSite::Strict)
            .secure(secure)
            .max_age(cookie::time::Duration::seconds(ttl.as_secs() as i64))
            .build()
            .to_string()
    }

    /// The session a request's `Cookie` headers name, if live.
    pub(crate) fn role<'a>(&self, cookies: impl Iterator<Item = &'a str>) -> Option<Role> {
        let id = self.id(cookies)?;
        let live = self.live.lock().expect("not poisoned");
        live.get(&id)
            .filter(|s| s.expires > Instant::now())
            .map(|s| s.role)
    }

    fn id<'a>(&self, cookies: impl Iterator<Item = &'a str>) -> Option<String> {
        cookies
            .flat_map(Cookie::split_parse)
            .filter_map(Result::ok)
            .find(|c| c.name() == self.cookie_name && !c.value().is_empty())
            .map(|c| c.value().to_string())
    }

    /// Ends the session the cookies name; answers the `Set-Cookie` value that clears it.
    pub(crate) fn end<'a>(&self, cookies: impl Iterator<Item = &'a str>, secure: bool) -> String {
        if let Some(id) = self.id(cookies) {
            self.live.lock().expect("not poisoned").remove(&id);
        }
        self.cookie(String::new(), Duration::ZERO, secure)
    }

    /// `Err(wait)` if `client` must wait before trying a token again.
    pub(crate) fn may_try(&self, client: IpAddr) -> Result<(), Duration> {
        let now = Instant::now();
        let mut f = self.failures.lock().expect("not poisoned");
        let (per_client, window, in_window) = &mut *f;
        if now.duration_since(*window) < Duration::from_secs(1)
            && *in_window >= GLOBAL_FAILURES_PER_SEC
        {
            return Err(Duration::from_secs(1));
        }
        match per_client.get(&client).and_then(|c| c.until) {
            Some(until) if until > now => Err(until - now),
            _ => Ok(()),
        }
    }

    /// Counts a failed login from `client`: after five, it waits 1 s, then 2 s, 4 s … up
    /// to a minute before each next try.
    pub(crate) fn failed(&self, client: IpAddr) {
        let now = Instant::now();
        let mut f = self.failures.lock().expect("not poisoned");
        let (per_client, window, in_window) = &mut *f;
        if now.duration_since(*window) >= Duration::from_secs(1) {
            (*window, *in_window) = (now, 0);
        }
        *in_window += 1;
        if per_client.len() > MAX_SESSIONS {
            per_client.retain(|_, c| c.until.is_some_and(|u| u > now));
        }
        let c = per_client.entry(client).or_default();
        c.count += 1;
        if c.count >= FREE_FAILURES {
            let doublings = (c.count - FREE_FAILURES).min(6);
            c.until = Some(now + (Duration::from_secs(1) * (1 << doublings)).min(MAX_PENALTY));
        }
    }

    /// Forgets `client`'s failures (it logged in).
    pub(crate) fn succeeded(&self, client: IpAddr) {
        self.failures
            .lock()
            .expect("not poisoned")
            .0
            .remove(&client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_a_random_cookie_that_ends() {
        let s = Sessions::new(8080, Duration::from_secs(60));
        let set = s.start(Role::ReadOnly, true);
        for part in [
            "ax_session_8080=",
            "HttpOnly",
            "SameSite=Strict",
            "Secure",
            "Max-Age=60",
        ] {
            assert!(set.contains(part), "{set}");
        }
        let pair = set.split(';').next().unwrap().to_string();
        assert_eq!(pair.len(), "ax_session_8080=".len() + 43);
        assert_eq!(s.role([pair.as_str()].into_iter()), Some(Role::ReadOnly));
        assert_eq!(s.role(["ax_session_8080="].into_iter()), None);
        assert_eq!(s.role(["ax_session_9090=x; other=1"].into_iter()), None);
        let cleared = s.end([format!("a=b; {pair}").as_str()].into_iter(), false);
        assert!(
            cleared.contains("Max-Age=0") && !cleared.contains("Secure"),
            "{cleared}"
        );
        assert_eq!(s.role([pair.as_str()].into_iter()), None);
        let expired = Sessions::new(1, Duration::ZERO);
        let pair = expired.start(Role::Admin, false);
        let pair = pair.split(';').next().unwrap();
        assert_eq!(expired.role([pair].into_iter()), None);
    }

    #[test]
    fn failed_logins_wait_longer_and_longer() {
        let s = Sessions::new(1, Duration::from_secs(60));
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        for _ in 0..FREE_FAILURES - 1 {
            assert!(s.may_try(a).is_ok());
            s.failed(a);
        }
        s.failed(a);
        let wait = s.may_try(a).unwrap_err();
        assert!(wait > Duration::from_millis(900) && wait <= Duration::from_secs(1));
        s.failed(a);
        assert!(s.may_try(a).unwrap_err() > Duration::from_millis(1900));
        assert!(s.may_try(b).is_ok(), "another client is not held back");
        s.succeeded(a);
        assert!(s.may_try(a).is_ok());
        assert!(same("token-1", "token-1") && !same("token-1", "token-2") && !same("", "x"));
    }
}
