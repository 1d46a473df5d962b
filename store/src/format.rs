//! Every on-disk constant of the store in one place: versions, file and directory names,
//! metadata keys, domain tags, journal layout and permissions.
//!
//! Everything on disk is little-endian and sized explicitly (`u32`, `u64`); `usize` never
//! reaches a file. Changing anything here changes the format: bump [`FORMAT_VERSION`], add a
//! line to the version log in docs/store-format.md and keep an old-format fixture.

/// Version of the block file format and of the directory layout. 2: a hybrid model's
/// snapshot blocks carry layer-state planes after the K/V planes (docs/store-format.md).
pub const FORMAT_VERSION: u32 = 2;

/// Value of the `kvstore.format` metadata key: names the file as a kvstore block.
pub const FORMAT_NAME: &str = "kvstore-block";

/// Name of the store marker file at the root: JSON with format name, version and budget.
pub const STORE_FILE: &str = "kvstore-store.json";
/// `format` field of the store marker file.
pub const STORE_FORMAT_NAME: &str = "kvstore-store";
/// Lock file at the root; the single writer holds an exclusive `flock` on it.
pub const LOCK_FILE: &str = "LOCK";
/// Access journal at the root: the persisted LRU order of the SSD tier.
pub const JOURNAL_FILE: &str = "access.journal";
/// Durable pins at the root (JSON: namespace, key, expiry per pin; see `pins.rs`).
pub const PINS_FILE: &str = "pins.json";
/// Directory for temporary files; everything in it is an orphan when a writer opens.
pub const TMP_DIR: &str = "tmp";
/// Directory that receives files that failed verification.
pub const QUARANTINE_DIR: &str = "quarantine";
/// Per-namespace description file, for humans and `kvstore inspect`.
pub const NAMESPACE_FILE: &str = "namespace.json";
/// Name of a namespace's cost model (the engine's measured prefill and restore speeds per
/// device, opaque JSON to the store).
pub const COSTS_FILE: &str = "costs.json";
/// Largest cost-model file read back, in bytes.
pub const MAX_COSTS_LEN: u64 = 64 * 1024;
/// Extension of block files.
pub const BLOCK_EXT: &str = "safetensors";
/// Extension of temporary files.
pub const TMP_EXT: &str = "tmp";
/// Extension given to quarantined files.
pub const QUARANTINE_EXT: &str = "bad";

/// Mode of every directory the store creates.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file the store creates.
pub const FILE_MODE: u32 = 0o600;

/// Safetensors metadata key: format name ([`FORMAT_NAME`]).
pub const META_FORMAT: &str = "kvstore.format";
/// Safetensors metadata key: format version, decimal.
pub const META_VERSION: &str = "kvstore.version";
/// Safetensors metadata key: namespace id, 64 lowercase hex digits.
pub const META_NAMESPACE: &str = "kvstore.namespace";
/// Safetensors metadata key: block key, 64 lowercase hex digits.
pub const META_KEY: &str = "kvstore.key";
/// Safetensors metadata key: parent key, 64 lowercase hex digits.
pub const META_PARENT: &str = "kvstore.parent";
/// Safetensors metadata key: block position (index in the chain), decimal.
pub const META_POSITION: &str = "kvstore.position";
/// Safetensors metadata key: token ids, decimal, comma separated.
pub const META_TOKENS: &str = "kvstore.tokens";
/// Safetensors metadata key: creation time, Unix milliseconds, decimal.
pub const META_CREATED: &str = "kvstore.created_unix_ms";
/// Safetensors metadata key: plane names in block order, comma separated.
pub const META_PLANES: &str = "kvstore.planes";
/// Safetensors metadata key: block checksum, `blake3:` + 64 lowercase hex digits.
pub const META_CHECKSUM: &str = "kvstore.checksum";
/// Prefix of the checksum value.
pub const CHECKSUM_PREFIX: &str = "blake3:";

/// Domain tag that opens the canonical namespace encoding.
pub const NAMESPACE_DOMAIN: &[u8] = b"kvstore.namespace";
/// Version of the canonical namespace encoding.
pub const NAMESPACE_ENCODING_VERSION: u32 = 1;
/// Domain tag that opens the checksum input of a block.
pub const CHECKSUM_DOMAIN: &[u8] = b"kvstore.block.checksum";

/// Largest safetensors header the store accepts, in bytes: a corrupt or hostile length never
/// makes a read allocate more. A block of a 128-layer model with quantized K/V (6 planes
/// per layer) has a header of about 100 KiB, so 1 MiB leaves a factor of ten.
pub const MAX_HEADER_LEN: u64 = 1024 * 1024;

/// Journal file header: magic (8 bytes) then version (`u32`) then 4 reserved zero bytes.
pub const JOURNAL_MAGIC: &[u8; 8] = b"KVSJRNL\0";
/// Length of the journal file header.
pub const JOURNAL_HEADER_LEN: usize = 16;
/// Magic opening each journal record (`u32`, little-endian).
pub const JOURNAL_RECORD_MAGIC: u32 = 0x4A53_564B;
/// Length of one journal record: magic u32, kind u32, namespace 32, key 32, seq u64,
/// time u64, check u32 (first 4 bytes of blake3 over the preceding 88 bytes).
pub const JOURNAL_RECORD_LEN: usize = 92;
/// Journal record kind: the block was written or read.
pub const JOURNAL_KIND_ACCESS: u32 = 1;

/// Allocation granularity assumed when estimating a file's physical size before writing it.
pub const ASSUMED_FS_BLOCK: u64 = 4096;
