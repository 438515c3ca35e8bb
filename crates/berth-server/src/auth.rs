//! Bearer tokens with scopes. Only SHA-256 hashes are stored; a presented token is
//! compared against every stored hash in constant time.

use sha2::{Digest, Sha256};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    Read,
    Operator,
    Admin,
}

impl Scope {
    pub fn parse(s: &str) -> Option<Scope> {
        match s {
            "read" => Some(Scope::Read),
            "operator" => Some(Scope::Operator),
            "admin" => Some(Scope::Admin),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Operator => "operator",
            Scope::Admin => "admin",
        }
    }
}

/// What a token may do: its scope, and the user it acts for when it registers
/// processes (S3). `uid: None` acts for the daemon's own user (the admin token, and
/// tokens made without a `uid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub scope: Scope,
    pub uid: Option<u32>,
    /// Unix milliseconds (wall clock: a token outlives restarts and reboots) after
    /// which the token is refused; `None`: until revoked.
    pub expires_ms: Option<u64>,
    /// A fleet token (issue 38 Build 3): kept in the fleet store and honoured by every
    /// host, which mirrors it into its ledger; revoked on any host, gone from all.
    pub fleet: bool,
}

impl Grant {
    /// The ledger keeps a grant as text: `scope`, then `;uid=N` and `;expires=MS` when
    /// set, and `;fleet` for a fleet token (the store knows nothing of its shape).
    pub fn parse(s: &str) -> Option<Grant> {
        let (s, fleet) = match s.strip_suffix(";fleet") {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        let mut parts = s.split(';');
        let mut g = Grant {
            scope: Scope::parse(parts.next()?)?,
            uid: None,
            expires_ms: None,
            fleet,
        };
        for part in parts {
            // Each at most once, in this order: one text per grant.
            match part.split_once('=')? {
                ("uid", n) if g.uid.is_none() && g.expires_ms.is_none() => {
                    g.uid = Some(n.parse().ok()?)
                }
                ("expires", ms) if g.expires_ms.is_none() => g.expires_ms = Some(ms.parse().ok()?),
                _ => return None,
            }
        }
        Some(g)
    }

    pub fn stored(&self) -> String {
        let mut s = self.scope.as_str().to_string();
        if let Some(u) = self.uid {
            s.push_str(&format!(";uid={u}"));
        }
        if let Some(ms) = self.expires_ms {
            s.push_str(&format!(";expires={ms}"));
        }
        if self.fleet {
            s.push_str(";fleet");
        }
        s
    }

    /// Whether the token has expired at `wall_ms`.
    pub fn expired(&self, wall_ms: u64) -> bool {
        self.expires_ms.is_some_and(|e| e <= wall_ms)
    }
}

/// A token's public name: the first 16 hex digits of its hash (what `berth token list`
/// shows and `revoke` takes; never the secret).
pub fn token_id(hash: &str) -> &str {
    &hash[..hash.len().min(16)]
}

pub fn hash_token(token: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(token.as_bytes());
    let mut out = String::with_capacity(2 * digest.len());
    for b in digest {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
    out
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The scope of `token`, if it is known. Walks every entry so the time taken does not
/// depend on which (if any) matched.
pub fn lookup(tokens: &[(String, Grant)], token: &str) -> Option<Grant> {
    lookup_keyed(tokens, token).map(|(g, _)| g)
}

/// [`lookup`], with a key that names the token in per-token counts (S10): the first
/// 64 bits of its hash, never the token itself.
pub fn lookup_keyed(tokens: &[(String, Grant)], token: &str) -> Option<(Grant, u64)> {
    let h = hash_token(token);
    let key = u64::from_str_radix(&h[..16], 16).unwrap_or(0);
    let mut found = None;
    for (hash, scope) in tokens {
        if ct_eq(hash.as_bytes(), h.as_bytes()) {
            found = Some(*scope);
        }
    }
    found.map(|g| (g, key))
}

/// 32 random bytes from the kernel, hex: 256 bits of secret.
pub fn new_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut buf = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(format!(
        "berth_{}",
        buf.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_their_hash() {
        let t = new_token().unwrap();
        let g = |scope, uid| Grant {
            scope,
            uid,
            expires_ms: None,
            fleet: false,
        };
        let tokens = vec![
            (hash_token(&t), g(Scope::Operator, Some(1000))),
            (hash_token("other"), g(Scope::Admin, None)),
        ];
        assert_eq!(lookup(&tokens, &t), Some(g(Scope::Operator, Some(1000))));
        assert_eq!(lookup(&tokens, "other"), Some(g(Scope::Admin, None)));
        assert_eq!(lookup(&tokens, "nope"), None);
        assert!(Scope::Admin > Scope::Operator && Scope::Operator > Scope::Read);
    }

    #[test]
    fn grants_round_trip_through_their_stored_text() {
        for s in [
            "read",
            "operator;uid=1000",
            "admin;uid=0",
            "read;expires=1796084403123",
            "operator;uid=65534;expires=1",
            "admin;fleet",
            "operator;uid=1000;expires=5;fleet",
        ] {
            assert_eq!(Grant::parse(s).unwrap().stored(), s);
        }
        for bad in [
            "root",
            "operator;uid=",
            "operator;uid=-1",
            "operator;uid=1;uid=2",
            "operator;expires=1;uid=2",
            "read;expires=1;expires=2",
            "read;expires=soon",
            "read;fleet;fleet",
            "fleet",
            "read;fleet;uid=1",
        ] {
            assert_eq!(Grant::parse(bad), None, "{bad}");
        }
        let g = Grant::parse("read;expires=1000").unwrap();
        assert!(!g.expired(999) && g.expired(1000));
    }

    /// Hashes already in ledgers must keep matching: lowercase hex SHA-256.
    #[test]
    fn token_hashes_are_lowercase_hex_sha256() {
        assert_eq!(
            hash_token("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
