//! The access journal: an append-only log of (namespace, key, sequence, time) records that
//! persists the SSD tier's LRU order. Losing it loses recency, never data: the order is then
//! rebuilt from file modification times.

use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::format;
use crate::fs::{FileSystem, WritableFile};
use crate::key::{BlockKey, NamespaceId};

/// One access record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    pub ns: NamespaceId,
    pub key: BlockKey,
    pub seq: u64,
    pub unix_ms: u64,
}

impl Record {
    fn encode(&self) -> [u8; format::JOURNAL_RECORD_LEN] {
        let mut b = [0u8; format::JOURNAL_RECORD_LEN];
        b[0..4].copy_from_slice(&format::JOURNAL_RECORD_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&format::JOURNAL_KIND_ACCESS.to_le_bytes());
        b[8..40].copy_from_slice(self.ns.as_bytes());
        b[40..72].copy_from_slice(self.key.as_bytes());
        b[72..80].copy_from_slice(&self.seq.to_le_bytes());
        b[80..88].copy_from_slice(&self.unix_ms.to_le_bytes());
        let check = blake3::hash(&b[..88]);
        b[88..92].copy_from_slice(&check.as_bytes()[..4]);
        b
    }

    fn decode(b: &[u8]) -> Option<Record> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if b.len() != format::JOURNAL_RECORD_LEN
            || u32_at(0) != format::JOURNAL_RECORD_MAGIC
            || u32_at(4) != format::JOURNAL_KIND_ACCESS
            || blake3::hash(&b[..88]).as_bytes()[..4] != b[88..92]
        {
            return None;
        }
        Some(Record {
            ns: NamespaceId(b[8..40].try_into().ok()?),
            key: BlockKey(b[40..72].try_into().ok()?),
            seq: u64_at(72),
            unix_ms: u64_at(80),
        })
    }
}

fn header() -> [u8; format::JOURNAL_HEADER_LEN] {
    let mut h = [0u8; format::JOURNAL_HEADER_LEN];
    h[..8].copy_from_slice(format::JOURNAL_MAGIC);
    h[8..12].copy_from_slice(&format::FORMAT_VERSION.to_le_bytes());
    h
}

/// What reading a journal found.
pub(crate) struct ReadJournal {
    pub records: Vec<Record>,
    /// True when the file was missing, foreign, or ended in a torn or corrupt record.
    pub damaged: bool,
}

/// Reads every valid record up to the first invalid one.
pub(crate) fn read<F: FileSystem>(fs: &F, path: &Path) -> io::Result<ReadJournal> {
    // No cap beyond memory: the journal is the tier's own file, bounded by compaction.
    let bytes = match fs.read_capped(path, u64::MAX - 1) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(ReadJournal {
                records: Vec::new(),
                damaged: true,
            })
        }
        Err(e) => return Err(e),
    };
    Ok(parse(&bytes))
}

/// Parses a journal file's bytes: every valid record up to the first invalid one.
pub(crate) fn parse(bytes: &[u8]) -> ReadJournal {
    if bytes.len() < format::JOURNAL_HEADER_LEN || bytes[..format::JOURNAL_HEADER_LEN] != header() {
        return ReadJournal {
            records: Vec::new(),
            damaged: true,
        };
    }
    let body = &bytes[format::JOURNAL_HEADER_LEN..];
    let mut records = Vec::with_capacity(body.len() / format::JOURNAL_RECORD_LEN);
    let mut damaged = !body.len().is_multiple_of(format::JOURNAL_RECORD_LEN);
    for chunk in body.chunks_exact(format::JOURNAL_RECORD_LEN) {
        match Record::decode(chunk) {
            Some(r) => records.push(r),
            None => {
                damaged = true;
                break;
            }
        }
    }
    ReadJournal { records, damaged }
}

/// The bytes of a journal holding `records` (what [`Journal::rewrite`] writes).
pub(crate) fn encode(records: &[Record]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(format::JOURNAL_HEADER_LEN + records.len() * format::JOURNAL_RECORD_LEN);
    out.extend_from_slice(&header());
    for r in records {
        out.extend_from_slice(&r.encode());
    }
    out
}

/// An open journal, appending.
pub(crate) struct Journal<W: WritableFile> {
    path: PathBuf,
    out: BufWriter<W>,
    /// Records in the file (for deciding when to compact).
    pub records: u64,
}

/// A compacted journal written to its temp file and made durable, not yet in place
/// ([`Journal::write_compacted`]): the slow half of a compaction, which needs no lock.
pub(crate) struct Compacted<W: WritableFile> {
    tmp: PathBuf,
    path: PathBuf,
    out: BufWriter<W>,
    records: u64,
}

impl<W: WritableFile> Compacted<W> {
    /// Removes the temp file: the compaction is given up.
    pub fn discard<F: FileSystem<Writer = W>>(self, fs: &F) {
        let _ = fs.remove_file(&self.tmp);
    }

    /// Appends `later` (records appended to the old journal since the snapshot, buffered),
    /// renames the file into place and opens it for appending. The rename is not yet
    /// durable: the caller syncs the journal's directory, and may do so after releasing its
    /// lock (the old journal or the new one is there after a crash,
    /// both valid). On failure the temp file is removed and the old journal stays.
    pub fn install<F: FileSystem<Writer = W>>(
        mut self,
        fs: &F,
        later: &[Record],
    ) -> io::Result<Journal<W>> {
        let put = (|| {
            for r in later {
                self.out.write_all(&r.encode())?;
            }
            self.out.flush()?;
            fs.rename(&self.tmp, &self.path)?;
            fs.open_append(&self.path)
        })();
        match put {
            Ok(f) => Ok(Journal {
                path: self.path,
                out: BufWriter::new(f),
                records: self.records + later.len() as u64,
            }),
            Err(e) => {
                let _ = fs.remove_file(&self.tmp);
                Err(e)
            }
        }
    }
}

impl<W: WritableFile> Journal<W> {
    /// Atomically replaces the journal at `path` with `records` (temp file in `tmp_dir`,
    /// fsync, rename, fsync root) and opens it for appending.
    pub fn rewrite<F: FileSystem<Writer = W>>(
        fs: &F,
        path: &Path,
        tmp_dir: &Path,
        records: &[Record],
    ) -> io::Result<Journal<W>> {
        let j = Self::write_compacted(fs, path, tmp_dir, records)?.install(fs, &[])?;
        j.sync_parent(fs)?;
        Ok(j)
    }

    /// Writes `records` to a temp file in `tmp_dir` and fsyncs it: the first half of
    /// [`rewrite`](Self::rewrite), touching nothing the current journal at `path` uses, so
    /// the SSD tier runs it without its lock while appends go on (docs/store-format.md,
    /// "Access journal"). A failure removes the temp file.
    pub fn write_compacted<F: FileSystem<Writer = W>>(
        fs: &F,
        path: &Path,
        tmp_dir: &Path,
        records: &[Record],
    ) -> io::Result<Compacted<W>> {
        let tmp = tmp_dir.join(format!(
            "journal.{}.{}",
            std::process::id(),
            format::TMP_EXT
        ));
        let written = (|| {
            let mut w = BufWriter::new(fs.create_truncate(&tmp)?);
            w.write_all(&header())?;
            for r in records {
                w.write_all(&r.encode())?;
            }
            w.flush()?;
            w.get_mut().sync_all()?;
            Ok(w)
        })();
        match written {
            Ok(out) => Ok(Compacted {
                tmp,
                path: path.to_owned(),
                out,
                records: records.len() as u64,
            }),
            Err(e) => {
                let _ = fs.remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Makes a rename of the journal durable: fsyncs the directory it is in.
    pub fn sync_parent<F: FileSystem<Writer = W>>(&self, fs: &F) -> io::Result<()> {
        match self.path.parent() {
            Some(parent) => fs.sync_dir(parent),
            None => Ok(()),
        }
    }

    /// Appends one record (buffered).
    pub fn append(&mut self, r: &Record) -> io::Result<()> {
        self.records += 1;
        self.out.write_all(&r.encode())
    }

    /// Writes buffered records and fsyncs.
    pub fn sync(&mut self) -> io::Result<()> {
        self.out.flush()?;
        self.out.get_mut().sync_data()
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl<W: WritableFile> Drop for Journal<W> {
    fn drop(&mut self) {
        // Recency only; a failure here loses access order, never blocks.
        let _ = self.out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::RealFs;

    #[test]
    fn torn_tail_keeps_the_valid_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let recs: Vec<Record> = (0..3)
            .map(|i| Record {
                ns: NamespaceId([i; 32]),
                key: BlockKey([i + 1; 32]),
                seq: i as u64,
                unix_ms: 10 + i as u64,
            })
            .collect();
        drop(Journal::rewrite(&RealFs, &path, dir.path(), &recs).unwrap());
        let r = read(&RealFs, &path).unwrap();
        assert_eq!(r.records, recs);
        assert!(!r.damaged);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.truncate(bytes.len() - 5);
        bytes[format::JOURNAL_HEADER_LEN + format::JOURNAL_RECORD_LEN + 10] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let r = read(&RealFs, &path).unwrap();
        assert_eq!(r.records, recs[..1]);
        assert!(r.damaged);
    }
}
