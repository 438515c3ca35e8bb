//! TLS to the fleet's PostgreSQL (issue 38 Build 5), chosen by the `--store` string's
//! `sslmode` as libpq chooses it: `disable` (none), `allow` and `prefer` (the default:
//! encrypted if the server offers it), `require` (encrypted or no connection), both
//! without checking whose certificate it is, as libpq does without a root
//! certificate; `verify-ca` (the server's chain must lead to `sslrootcert`) and
//! `verify-full` (that, and the certificate must name the host connected to).
//! `sslrootcert` defaults to `~/.postgresql/root.crt`, as libpq's does.
//!
//! The client berth drives knows only `disable`, `prefer` and `require`, so
//! `sslmode` and `sslrootcert` are taken out of the string before it parses the rest.

use std::sync::Arc;

use postgres::config::SslMode;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::FleetError;

/// How a connection is made: in the clear, or through rustls.
#[derive(Clone)]
pub(crate) enum Tls {
    Off,
    Rustls(MakeRustlsConnect),
}

impl Tls {
    pub(crate) fn connect(
        &self,
        config: &postgres::Config,
    ) -> Result<postgres::Client, postgres::Error> {
        match self {
            Tls::Off => config.connect(postgres::NoTls),
            Tls::Rustls(tls) => config.connect(tls.clone()),
        }
    }
}

/// Parses a `--store` string: the client's configuration (its `sslmode` set) and how
/// to connect. A mode or root certificate that is not usable is refused, naming it.
pub(crate) fn parse(url: &str) -> Result<(postgres::Config, Tls), FleetError> {
    let (rest, mode, root) = take_tls_keys(url)?;
    let mut config: postgres::Config = rest
        .parse()
        .map_err(|e| FleetError::Invalid(format!("store: not a PostgreSQL URL: {e}")))?;
    let mode = mode.unwrap_or_else(|| "prefer".into());
    let (ssl_mode, check) = match mode.as_str() {
        "disable" => return Ok((config.ssl_mode(SslMode::Disable).clone(), Tls::Off)),
        "allow" | "prefer" => (SslMode::Prefer, Check::Nothing),
        "require" => (SslMode::Require, Check::Nothing),
        "verify-ca" => (SslMode::Require, Check::Chain),
        "verify-full" => (SslMode::Require, Check::ChainAndName),
        other => {
            return Err(FleetError::Invalid(format!(
                "store: sslmode {other:?} is not one of disable, allow, prefer, require, verify-ca, verify-full"
            )))
        }
    };
    config.ssl_mode(ssl_mode);
    let client = client_config(check, root)?;
    Ok((config, Tls::Rustls(MakeRustlsConnect::new(client))))
}

/// What of the server's certificate is checked.
#[derive(Clone, Copy, PartialEq)]
enum Check {
    Nothing,
    Chain,
    ChainAndName,
}

fn client_config(check: Check, root: Option<String>) -> Result<rustls::ClientConfig, FleetError> {
    // ring, not aws-lc-rs: it builds without cmake. rustls 0.23.48 deprecates it for
    // lacking post-quantum key exchange, which a link to the fleet's own database can
    // do without for now.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| FleetError::Invalid(format!("store: TLS: {e}")))?;
    let chain = match check {
        Check::Nothing => None,
        _ => {
            let roots = Arc::new(roots(root)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| FleetError::Invalid(format!("store: sslrootcert: {e}")))?;
            Some(webpki)
        }
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (check, chain) {
        (Check::ChainAndName, Some(webpki)) => webpki,
        (_, chain) => Arc::new(Lenient { provider, chain }),
    };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// The root certificates `sslrootcert` (or libpq's default file) holds.
fn roots(root: Option<String>) -> Result<RootCertStore, FleetError> {
    let path = match root {
        Some(p) => p,
        None => match std::env::var("HOME") {
            Ok(home) => format!("{home}/.postgresql/root.crt"),
            Err(_) => String::new(),
        },
    };
    let refuse = |why: String| {
        FleetError::Invalid(format!(
            "store: sslrootcert {path:?}: {why} (sslmode verify-ca and verify-full check the server's certificate against it)"
        ))
    };
    let certs = CertificateDer::pem_file_iter(&path).map_err(|e| refuse(e.to_string()))?;
    let mut store = RootCertStore::empty();
    for cert in certs {
        let cert = cert.map_err(|e| refuse(e.to_string()))?;
        store.add(cert).map_err(|e| refuse(e.to_string()))?;
    }
    match store.is_empty() {
        true => Err(refuse("no certificate in it".into())),
        false => Ok(store),
    }
}

/// `prefer` and `require` (no `chain`): encrypted, whoever the certificate names
/// (libpq's behaviour without a root certificate); `verify-ca`: the chain must lead to
/// a root, the name in the certificate is not looked at. The handshake's signatures
/// are checked against the certificate the server presented either way.
#[derive(Debug)]
struct Lenient {
    provider: Arc<CryptoProvider>,
    chain: Option<Arc<WebPkiServerVerifier>>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Splits `sslmode` and `sslrootcert` off a libpq URL (`postgres://…?sslmode=…`) or
/// key=value string: the rest, and their values.
type Split = (String, Option<String>, Option<String>);

fn take_tls_keys(url: &str) -> Result<Split, FleetError> {
    let (mut mode, mut root) = (None, None);
    let mut take = |key: &str, value: String| match key {
        "sslmode" => mode = Some(value),
        "sslrootcert" => root = Some(value),
        _ => unreachable!("only the TLS keys are taken"),
    };
    let is_tls = |k: &str| k == "sslmode" || k == "sslrootcert";
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return Ok((url.to_owned(), None, None));
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some((k, v)) if is_tls(k) => take(k, percent_decode(v)?),
                _ => kept.push(pair),
            }
        }
        match kept.is_empty() {
            true => base.to_owned(),
            false => format!("{base}?{}", kept.join("&")),
        }
    } else {
        let mut kept = Vec::new();
        for (k, raw, value) in key_values(url)? {
            match is_tls(k) {
                true => take(k, value),
                false => kept.push(raw),
            }
        }
        kept.join(" ")
    };
    Ok((rest, mode, root))
}

/// A key=value string's pairs: the key, the pair as written, and the value unquoted
/// (single quotes, backslash escapes, as libpq reads them).
fn key_values(s: &str) -> Result<Vec<(&str, &str, String)>, FleetError> {
    let bad = || FleetError::Invalid(format!("store: not a PostgreSQL connection string: {s:?}"));
    let mut out = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        let eq = rest.find('=').ok_or_else(bad)?;
        let key = rest[..eq].trim_end();
        let mut after = rest[eq + 1..].trim_start();
        let start = rest.len() - after.len();
        let mut value = String::new();
        let end = if let Some(quoted) = after.strip_prefix('\'') {
            let mut chars = quoted.char_indices();
            loop {
                match chars.next().ok_or_else(bad)? {
                    (i, '\'') => break start + 1 + i + 1,
                    (_, '\\') => value.push(chars.next().ok_or_else(bad)?.1),
                    (_, c) => value.push(c),
                }
            }
        } else {
            let n = after.find(char::is_whitespace).unwrap_or(after.len());
            value.push_str(&after[..n]);
            start + n
        };
        out.push((key, rest[..end].trim(), value));
        after = &rest[end..];
        rest = after.trim_start();
    }
    Ok(out)
}

fn percent_decode(v: &str) -> Result<String, FleetError> {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = v
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            let byte =
                hex.ok_or_else(|| FleetError::Invalid(format!("store: a bad %-escape in {v:?}")))?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| FleetError::Invalid(format!("store: {v:?} is not UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_keys_are_taken_out_of_both_forms() {
        let (rest, mode, root) = take_tls_keys(
            "host=db port=5432 sslmode=verify-full sslrootcert='/a b/c\\'d.pem' dbname=x",
        )
        .unwrap();
        assert_eq!(rest, "host=db port=5432 dbname=x");
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root.as_deref(), Some("/a b/c'd.pem"));
        let (rest, mode, root) = take_tls_keys(
            "postgres://u@db/x?sslmode=require&application_name=a&sslrootcert=%2Fr.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@db/x?application_name=a");
        assert_eq!(mode.as_deref(), Some("require"));
        assert_eq!(root.as_deref(), Some("/r.pem"));
        let (rest, mode, _) = take_tls_keys("postgres://u@db/x").unwrap();
        assert_eq!((rest.as_str(), mode), ("postgres://u@db/x", None));
    }

    #[test]
    fn a_bad_mode_or_root_is_refused_naming_it() {
        let e = parse("host=db sslmode=sometimes")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("sslmode") && e.contains("sometimes"), "{e}");
        let e = parse("host=db sslmode=verify-full sslrootcert=/nonexistent/root.pem")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("sslrootcert") && e.contains("/nonexistent/root.pem"),
            "{e}"
        );
        assert!(parse("host=db sslrootcert='unterminated").is_err());
    }
}
