//! Entry points for the fuzz targets (`fuzz/`) and the corpus replay tests: the parsers the
//! store runs on bytes it reads back from disk or from the remote tier, without the I/O
//! around them, and the `check_*` harnesses both run. Not a stable API.
//!
//! The parsers never panic; the `check_*` functions panic when an invariant between them
//! breaks (that is how a fuzzer or a test reports it).

use std::fs::File;
use std::os::unix::fs::FileExt;

use bytes::Bytes;

use crate::codec::{self, BlockHeader, DecodeError};
use crate::journal::{self, Record};
use crate::key::{BlockKey, NamespaceId};
use crate::Block;

/// Decodes and verifies a whole block file held in memory (what the remote tier does with
/// fetched bytes).
pub fn decode_block(bytes: &[u8]) -> Result<Block, DecodeError> {
    codec::decode(Bytes::copy_from_slice(bytes))
}

/// Reads and verifies the block file `file` of `len` bytes the way the SSD tier does, with
/// reads of `chunk_len` bytes (the pipelined path when the data is longer than one chunk).
/// The outer error is an I/O failure.
pub fn read_block_file(
    file: &File,
    len: u64,
    chunk_len: usize,
) -> std::io::Result<Result<Block, DecodeError>> {
    codec::read_file_in_chunks(file, len, chunk_len.max(1))
}

/// Parses the header of the block file `bytes` (length prefix and JSON, not the data)
/// the way `kvstore inspect` and GC read headers; does not verify the checksum.
pub fn parse_block_header(bytes: &[u8]) -> Result<BlockHeader, DecodeError> {
    let file_len = bytes.len() as u64;
    if bytes.len() < 8 {
        return Err(DecodeError::Truncated {
            needed: 8,
            found: file_len,
        });
    }
    let n = codec::header_len(
        u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8])),
        file_len,
    )?;
    codec::parse_header(&bytes[8..8 + n as usize], file_len)
}

/// One access-journal record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalRecord {
    /// Namespace of the block.
    pub namespace: NamespaceId,
    /// Key of the block.
    pub key: BlockKey,
    /// Sequence number.
    pub seq: u64,
    /// Access time, Unix milliseconds.
    pub unix_ms: u64,
}

/// Parses an access journal's bytes: the valid records before the first invalid one, and
/// whether the file was foreign, torn or corrupt.
pub fn parse_journal(bytes: &[u8]) -> (Vec<JournalRecord>, bool) {
    let read = journal::parse(bytes);
    let records = read
        .records
        .into_iter()
        .map(|r| JournalRecord {
            namespace: r.ns,
            key: r.key,
            seq: r.seq,
            unix_ms: r.unix_ms,
        })
        .collect();
    (records, read.damaged)
}

/// The bytes of a journal holding `records`, as the SSD tier writes it.
pub fn encode_journal(records: &[JournalRecord]) -> Vec<u8> {
    let records: Vec<Record> = records
        .iter()
        .map(|r| Record {
            ns: r.namespace,
            key: r.key,
            seq: r.seq,
            unix_ms: r.unix_ms,
        })
        .collect();
    journal::encode(&records)
}

/// Parses a directory name or file stem of the store layout into an id, accepting only the
/// canonical lowercase form the store writes.
pub fn parse_file_stem<T: std::str::FromStr + std::fmt::Display>(s: &str) -> Option<T> {
    crate::ssd::parse_canonical(s)
}

/// Runs `data` as a block file through every reader: the in-memory decode, the SSD tier's
/// file read in one read and in small chunks (`scratch` is an empty-able temporary file),
/// and the header parse. Panics unless all agree and a block that decodes has a header.
pub fn check_block_file(data: &[u8], scratch: &File) {
    let decoded = decode_block(data);
    let header = parse_block_header(data);
    let len = data.len() as u64;
    scratch.set_len(0).expect("truncate the scratch file");
    scratch
        .write_all_at(data, 0)
        .expect("write the scratch file");
    let whole = read_block_file(scratch, len, 1 << 20).expect("read the scratch file");
    let chunked = read_block_file(scratch, len, 256).expect("read the scratch file");
    assert_eq!(decoded, whole, "decode and the file read disagree");
    assert_eq!(whole, chunked, "one read and chunked reads disagree");
    if let Ok(block) = &decoded {
        let h = header.expect("a block that decodes has a header that parses");
        assert_eq!(h.meta, block.meta);
        let specs: Vec<_> = block.planes.iter().map(|p| p.spec()).collect();
        assert_eq!(h.planes, specs);
        assert_eq!(h.file_len, len);
    }
}

/// Runs `data` as an access journal. Panics unless replay keeps exactly a valid prefix and an
/// undamaged journal is byte for byte what the writer writes.
pub fn check_journal(data: &[u8]) {
    let (records, damaged) = parse_journal(data);
    let encoded = encode_journal(&records);
    if !records.is_empty() {
        assert!(
            data.starts_with(&encoded),
            "records not read from a valid prefix"
        );
    }
    assert_eq!(!damaged, data == encoded.as_slice());
    let (again, damaged_again) = parse_journal(&encoded);
    assert_eq!(again, records);
    assert!(!damaged_again);
}

/// Runs `data` as the text of a key or namespace id. Panics unless only 64 hex digits parse,
/// the text form round-trips, and the file-name parse takes only the canonical form.
pub fn check_key_text(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let key = s.parse::<BlockKey>();
    if let Ok(k) = key {
        assert_eq!(s.len(), 64);
        assert!(s.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(k.to_string(), s.to_ascii_lowercase());
        assert_eq!(k.to_string().parse::<BlockKey>().ok(), Some(k));
    }
    assert_eq!(s.parse::<NamespaceId>().is_ok(), key.is_ok());
    if let Some(k) = parse_file_stem::<BlockKey>(s) {
        assert_eq!(k.to_string(), s, "only the canonical form is accepted");
    }
}

/// The committed inputs of fuzz target `target` in this source tree: every file under
/// `fuzz/corpus/<target>` and `fuzz/seeds/<target>`, sorted (the corpus replay tests).
pub fn committed_inputs(target: &str) -> Vec<std::path::PathBuf> {
    let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "seeds"] {
        if let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) {
            files.extend(entries.filter_map(|e| e.ok()).map(|e| e.path()));
        }
    }
    files.sort();
    files
}
