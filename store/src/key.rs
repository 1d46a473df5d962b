//! Block keys and namespace ids: 32-byte blake3 hashes with lowercase hex text forms.

use std::fmt;
use std::str::FromStr;

/// Why a string is not a key or namespace id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseKeyError {
    /// The string does not have exactly 64 characters.
    #[error("expected 64 hex digits, got {0} characters")]
    Length(usize),
    /// The string contains a character that is not a hex digit.
    #[error("expected only hex digits 0-9a-f, found {0:?}")]
    NotHex(char),
}

fn parse_hex32(s: &str) -> Result<[u8; 32], ParseKeyError> {
    if s.len() != 64 {
        return Err(ParseKeyError::Length(s.chars().count()));
    }
    let mut out = [0u8; 32];
    let bytes = s.as_bytes();
    for (i, byte) in out.iter_mut().enumerate() {
        let hi = hex_val(bytes[2 * i])?;
        let lo = hex_val(bytes[2 * i + 1])?;
        *byte = (hi << 4) | lo;
    }
    Ok(out)
}

fn hex_val(c: u8) -> Result<u8, ParseKeyError> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(ParseKeyError::NotHex(c as char)),
    }
}

fn write_hex(bytes: &[u8; 32], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for b in bytes {
        write!(f, "{b:02x}")?;
    }
    Ok(())
}

macro_rules! hash_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; 32]);

        impl $name {
            /// The 32 raw bytes.
            pub fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            /// Lowercase hex, 64 characters.
            pub fn to_hex(&self) -> String {
                self.to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_hex(&self.0, f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}(", stringify!($name))?;
                write_hex(&self.0, f)?;
                write!(f, ")")
            }
        }

        impl FromStr for $name {
            type Err = ParseKeyError;
            /// Parses exactly 64 hex digits; anything else (paths, separators) is refused.
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                parse_hex32(s).map($name)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

hash_id!(
    /// Names a block by its whole prefix: `blake3(parent key || token ids)`.
    BlockKey
);
hash_id!(
    /// Names everything that changes the bytes of a block; the root parent of every chain.
    NamespaceId
);

/// The key of a block: `blake3(parent || t0 || t1 || ...)`, each token id a little-endian
/// `u32`; `parent` is the previous block's key, or the namespace id for the first block.
pub fn block_key(parent: &[u8; 32], tokens: &[u32]) -> BlockKey {
    let mut hasher = blake3::Hasher::new();
    hasher.update(parent);
    for t in tokens {
        hasher.update(&t.to_le_bytes());
    }
    BlockKey(*hasher.finalize().as_bytes())
}

/// The keys of the full blocks of `tokens` in namespace `ns`; a trailing partial block has
/// no key. Returns an empty list when `block_size` is 0.
pub fn chain_keys(ns: NamespaceId, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = ns.0;
    tokens
        .chunks_exact(block_size)
        .map(|chunk| {
            let key = block_key(&parent, chunk);
            parent = key.0;
            key
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_rejects_non_hex() {
        let k = block_key(&[7; 32], &[1, 2, 3]);
        assert_eq!(k.to_string().parse::<BlockKey>().unwrap(), k);
        assert_eq!(k.to_string().to_uppercase().parse::<BlockKey>().unwrap(), k);
        assert!(matches!(
            "../etc".parse::<BlockKey>(),
            Err(ParseKeyError::Length(6))
        ));
        let mut bad = k.to_string();
        bad.replace_range(10..11, "/");
        assert_eq!(bad.parse::<BlockKey>(), Err(ParseKeyError::NotHex('/')));
    }

    #[test]
    fn chain_keys_skip_partial_block_and_link_parents() {
        let ns = NamespaceId([1; 32]);
        let keys = chain_keys(ns, &[1, 2, 3, 4, 5], 2);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], block_key(&ns.0, &[1, 2]));
        assert_eq!(keys[1], block_key(&keys[0].0, &[3, 4]));
        assert!(chain_keys(ns, &[1, 2], 0).is_empty());
    }
}
