//! TensorBoard's event files, written without TensorFlow: a run's scalars where researchers
//! already look (`tensorboard --logdir DIR`).
//!
//! An event file is a log of records, each `u64` length (little-endian), the masked CRC-32C of
//! those 8 bytes, the data, and the masked CRC-32C of the data ([`record`]); each record's data
//! is one `Event` protocol buffer ([`encode_event`]): `wall_time` (field 1, double), `step` (2,
//! int64), `file_version` (3, string), `summary` (5: `Summary { value: repeated Value { tag: 1
//! string, simple_value: 2 float } }`) and `session_log` (7: `SessionLog { status: 1 enum }`).
//! The first record of a file is an event whose `file_version` is [`FILE_VERSION`]. TensorBoard
//! reads every file whose name holds `tfevents` in a directory as one run, and every
//! subdirectory of `--logdir` holding such files as a run of its own.
//!
//! [`EventWriter`] writes one file; [`TensorBoard`] is a [`TrainObserver`] that writes every
//! step's scalars ([`step_scalars`]) into a directory of its own.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::observe::{RunStart, TrainObserver};
use crate::outcome::StepRecord;

/// The `file_version` of the first event of every file: TensorBoard then reads a
/// `SessionLog::START` event as a restart and drops what the directory holds at or after its
/// step ([`EventWriter::start_session`]).
pub const FILE_VERSION: &str = "brain.Event:2";

/// The mean training loss over the ranks, before the step's update ([`StepRecord::loss`]).
pub const LOSS: &str = "train/loss";
/// The held-out loss after the step, on the steps that evaluate ([`StepRecord::val_loss`]).
pub const VAL_LOSS: &str = "train/val_loss";
/// The learning rate of the step's update ([`StepRecord::lr`]).
pub const LR: &str = "train/lr";
/// The global gradient norm before clipping, when clipping ([`StepRecord::grad_norm`]).
pub const GRAD_NORM: &str = "train/grad_norm";
/// The payload bytes rank 0's DDP handed to its collectives in the step
/// ([`brigade_comm::CommBytes::payload_bytes`] of [`StepRecord::sent`]).
pub const BYTES_SENT: &str = "train/bytes_sent";
/// Rank 0's wall time of the step, in milliseconds ([`StepRecord::ms`]).
pub const STEP_MS: &str = "train/step_ms";
/// A model's prediction of the step time, in milliseconds, where a command has one (the
/// overlap model's of `brigade sweep`'s bucket caps).
pub const PREDICTED_STEP_MS: &str = "predicted/step_ms";

/// The tag of a prediction of the step on a link of `gbps` Gb/s at `latency_us` µs per
/// message, in milliseconds (a study's, one per link), beside [`PREDICTED_STEP_MS`] in its
/// group: `predicted/step_ms_1gbps_20us` (the numbers as Rust prints them: `0.5gbps`).
pub fn predicted_ms_tag(gbps: f64, latency_us: f64) -> String {
    format!("{PREDICTED_STEP_MS}_{gbps}gbps_{latency_us}us")
}

/// The directory in `dir` of one run among several (a command's run per policy or setting),
/// named `name` as a file name may hold it: a policy's spec keeps its `:` and `@`; anything
/// that would make a path (or that a shell would need quoted) is `_`.
pub fn run_dir(dir: &Path, name: &str) -> PathBuf {
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._:@+=-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(name)
}

/// The CRC-32C (Castagnoli) table, reflected polynomial `0x82F63B78`, one entry per byte.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// The CRC-32C (Castagnoli) of `bytes`, as iSCSI and TFRecord compute it (`"123456789"` gives
/// `0xE3069283`).
pub fn crc32c(bytes: &[u8]) -> u32 {
    !bytes.iter().fold(!0u32, |crc, &b| {
        CRC32C_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// The CRC-32C of `bytes` masked as TFRecord stores it: rotated right by 15 bits, plus
/// `0xa282ead8` (a CRC of data that holds CRCs is then not a CRC of CRCs).
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    crc32c(bytes).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record of an event file around `data`: its length (`u64`, little-endian), that
/// length's masked CRC-32C, the data, the data's masked CRC-32C.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// What an event says besides its time and step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EventBody<'a> {
    /// The file's version ([`FILE_VERSION`]): the first event of a file.
    FileVersion(&'a str),
    /// Scalars of one step, as `(tag, value)`.
    Scalars(&'a [(&'a str, f32)]),
    /// A run (re)starts at the event's step: `SessionLog { status: START }`.
    SessionStart,
}

/// Appends `v` as a protocol-buffer varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends field `field` of wire type 2 (length-delimited: a string or a message).
fn length_delimited(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The `Event` protocol buffer at `wall_time` (seconds since the Unix epoch) and `step`.
pub fn encode_event(wall_time: f64, step: i64, body: EventBody<'_>) -> Vec<u8> {
    let mut out = vec![];
    // wall_time: field 1, wire type 1 (64-bit)
    out.push(1 << 3 | 1);
    out.extend_from_slice(&wall_time.to_le_bytes());
    // step: field 2, wire type 0 (varint; a negative int64 is its two's complement)
    out.push(2 << 3);
    varint(&mut out, step as u64);
    match body {
        EventBody::FileVersion(v) => length_delimited(&mut out, 3, v.as_bytes()),
        EventBody::Scalars(scalars) => {
            let mut summary = vec![];
            for (tag, value) in scalars {
                let mut v = vec![];
                length_delimited(&mut v, 1, tag.as_bytes());
                // simple_value: field 2, wire type 5 (32-bit)
                v.push(2 << 3 | 5);
                v.extend_from_slice(&value.to_le_bytes());
                length_delimited(&mut summary, 1, &v);
            }
            length_delimited(&mut out, 5, &summary);
        }
        // status: field 1, varint; START is 1
        EventBody::SessionStart => length_delimited(&mut out, 7, &[1 << 3, 1]),
    }
    out
}

/// Seconds since the Unix epoch, now.
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name, as a file name may hold it (`localhost` when it cannot be read).
fn host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "localhost".into());
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Event files this process opened, so that two in one second get two names.
static FILES_OPENED: AtomicUsize = AtomicUsize::new(0);

/// One event file, written as the run goes: each event is one record appended with one write
/// (no buffer), so a run that dies keeps every event written before (TensorBoard reads up to a
/// torn last record). It is a log, not a document, so it is not written beside and renamed
/// over as Brigade's other outputs are: a rename would publish the events only at the end,
/// and lose them all when the run died first.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates `dir` (and its parents) when missing and a new event file in it, named as
    /// TensorFlow's writers name theirs (`events.out.tfevents.<seconds>.<host>.<pid>.<n>`,
    /// never an existing file's), and writes its first event ([`FILE_VERSION`]).
    pub fn create(dir: &Path) -> Result<EventWriter> {
        let io = |path: &Path, source| Error::Io {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let seconds = now() as u64;
        let (host, pid) = (host_name(), std::process::id());
        loop {
            let n = FILES_OPENED.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!("events.out.tfevents.{seconds:010}.{host}.{pid}.{n}"));
            match std::fs::OpenOptions::new().append(true).create_new(true).open(&path) {
                Ok(file) => {
                    let mut w = EventWriter { path, file };
                    w.write(0, EventBody::FileVersion(FILE_VERSION))?;
                    return Ok(w);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io(&path, e)),
            }
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event at `step`, now.
    pub fn write(&mut self, step: u64, body: EventBody<'_>) -> Result<()> {
        let step = i64::try_from(step).unwrap_or(i64::MAX);
        self.file
            .write_all(&record(&encode_event(now(), step, body)))
            .map_err(|source| Error::Io {
                path: self.path.display().to_string(),
                source,
            })
    }

    /// Appends `scalars` (`(tag, value)`) of `step`, as one event.
    pub fn add_scalars(&mut self, step: u64, scalars: &[(&str, f32)]) -> Result<()> {
        self.write(step, EventBody::Scalars(scalars))
    }

    /// Says that a run starts at `step` (`SessionLog::START`): TensorBoard drops the events of
    /// its directory at or after `step` read before this one, so that a run resumed from an
    /// earlier checkpoint, or a fresh run in the directory of an earlier one, is one curve.
    pub fn start_session(&mut self, step: u64) -> Result<()> {
        self.write(step, EventBody::SessionStart)
    }
}

/// The scalars of one step, as `(tag, value)`: [`LOSS`], [`LR`], [`BYTES_SENT`], [`STEP_MS`],
/// and [`VAL_LOSS`] and [`GRAD_NORM`] where the step has them.
pub fn step_scalars(r: &StepRecord) -> Vec<(&'static str, f32)> {
    let mut s = vec![(LOSS, r.loss as f32), (LR, r.lr as f32)];
    if let Some(v) = r.val_loss {
        s.push((VAL_LOSS, v as f32));
    }
    if let Some(n) = r.grad_norm {
        s.push((GRAD_NORM, n as f32));
    }
    s.push((BYTES_SENT, r.sent.payload_bytes as f32));
    s.push((STEP_MS, r.ms as f32));
    s
}

/// What a [`TensorBoard`] holds: its file once opened, or that it stopped writing and why
/// (until the caller takes it).
#[derive(Debug, Default)]
struct Sink {
    writer: Option<EventWriter>,
    failed: bool,
    failure: Option<Error>,
}

/// An observer that writes a run's scalars into TensorBoard event files in its directory: rank
/// 0 opens a new file there when the run starts (so under MPI the process of rank 0 alone
/// writes), says that the run starts at its first step ([`EventWriter::start_session`]: a
/// resume from an earlier checkpoint replaces the steps after it), then appends every step's
/// [`step_scalars`] as it finishes. Other scalars of the run (a prediction) go in the same file
/// through [`TensorBoard::add_scalars`].
///
/// A write that fails never stops the run and never panics: the first failure is kept
/// ([`TensorBoard::take_failure`]: the caller reports it once) and nothing more is written
/// (what was written stays readable).
///
/// ```no_run
/// # use std::sync::Arc;
/// # use brigade::config::Instrumentation;
/// let tb = Arc::new(brigade::tensorboard::TensorBoard::new("runs/mlp"));
/// let instrument = Instrumentation { observer: Some(tb.clone()), ..Default::default() };
/// // ... fit(...), then:
/// if let Some(e) = tb.take_failure() {
///     eprintln!("tensorboard: {e}");
/// }
/// ```
#[derive(Debug)]
pub struct TensorBoard {
    dir: PathBuf,
    sink: Mutex<Sink>,
}

impl TensorBoard {
    /// Writes into `dir` (created when the run starts, if missing); nothing is opened yet.
    pub fn new(dir: impl Into<PathBuf>) -> TensorBoard {
        TensorBoard {
            dir: dir.into(),
            sink: Mutex::default(),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The event file, once opened.
    pub fn event_file(&self) -> Option<PathBuf> {
        self.lock().writer.as_ref().map(|w| w.path().to_path_buf())
    }

    /// Appends `scalars` of `step`, opening the file first if no run opened it. After a
    /// failure it does nothing.
    pub fn add_scalars(&self, step: u64, scalars: &[(&str, f32)]) {
        self.with_writer(step, |w| w.add_scalars(step, scalars));
    }

    /// The first write that failed (`None`: none did), taken: the events of the steps before it
    /// are in the file.
    pub fn take_failure(&self) -> Option<Error> {
        self.lock().failure.take()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sink> {
        self.sink.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `write` on the file (opened first when needed), unless an earlier write failed;
    /// keeps its failure, naming `step`.
    fn with_writer(&self, step: u64, write: impl FnOnce(&mut EventWriter) -> Result<()>) {
        let mut sink = self.lock();
        if sink.failed {
            return;
        }
        let written = match &mut sink.writer {
            Some(w) => write(w).map_err(|e| match e {
                Error::Io { path, source } => Error::Io {
                    path: format!("{path} (the events from step {step} on)"),
                    source,
                },
                e => e,
            }),
            None => EventWriter::create(&self.dir).and_then(|mut w| {
                let written = write(&mut w);
                sink.writer = Some(w);
                written
            }),
        };
        if let Err(e) = written {
            // a torn record ends what a reader takes from the file: write nothing after it
            sink.failed = true;
            sink.failure = Some(e);
        }
    }
}

impl TrainObserver for TensorBoard {
    fn run_started(&self, start: &RunStart) {
        let step = start.first_step as u64;
        self.with_writer(step, |w| w.start_session(step));
    }

    fn step_finished(&self, record: &StepRecord) {
        let step = record.step as u64;
        self.with_writer(step, |w| w.add_scalars(step, &step_scalars(record)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_published_check_values() {
        // the CRC catalogue's check value for CRC-32C, and RFC 3720's (iSCSI) B.4 vectors
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        let descending: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&descending), 0x113F_DB5C);
    }

    #[test]
    fn the_mask_rotates_right_by_15_and_adds_the_constant() {
        // crc 0xE3069283 rotated right by 15: low 15 bits 0x1283 move up 17 bits, the rest down:
        // (0x1283 << 17) | (0xE3069283 >> 15) = 0x25060000 | 0x1C60D = 0x2507C60D;
        // + 0xA282EAD8 = 0xC78AB0E5
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn a_record_is_its_length_its_crc_the_data_and_the_datas_crc() {
        let r = record(b"123456789");
        assert_eq!(r.len(), 8 + 4 + 9 + 4);
        assert_eq!(&r[..8], &9u64.to_le_bytes());
        assert_eq!(&r[8..12], &masked_crc32c(&9u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&r[12..21], b"123456789");
        assert_eq!(&r[21..], &0xC78A_B0E5u32.to_le_bytes());
    }

    #[test]
    fn varints_take_seven_bits_a_byte_low_first() {
        let enc = |v| {
            let mut out = vec![];
            varint(&mut out, v);
            out
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(127), [0x7f]);
        // 300 = 0b10_0101100: 0xAC (low 7 bits, more to come), then 0x02
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(u64::MAX).len(), 10);
    }

    #[test]
    fn events_encode_as_the_event_protocol_buffer() {
        let time = 1.5f64.to_le_bytes();
        // wall_time 1.5: 0x09 + 8 bytes; step 300: 0x10 0xAC 0x02; file_version: 0x1A, length 13
        let mut want = vec![0x09];
        want.extend_from_slice(&time);
        want.extend_from_slice(&[0x10, 0xac, 0x02, 0x1a, 13]);
        want.extend_from_slice(b"brain.Event:2");
        assert_eq!(encode_event(1.5, 300, EventBody::FileVersion(FILE_VERSION)), want);

        // summary (0x2A, 13) { value (0x0A, 11) { tag (0x0A, 4) "loss", simple_value (0x15) 0.25f32 } }
        let mut want = vec![0x09];
        want.extend_from_slice(&time);
        want.extend_from_slice(&[0x10, 7, 0x2a, 13, 0x0a, 11, 0x0a, 4]);
        want.extend_from_slice(b"loss");
        want.push(0x15);
        want.extend_from_slice(&0.25f32.to_le_bytes());
        assert_eq!(encode_event(1.5, 7, EventBody::Scalars(&[("loss", 0.25)])), want);

        // two values: two entries of the repeated field, in order
        let two = encode_event(1.5, 7, EventBody::Scalars(&[("a", 1.0), ("b", 2.0)]));
        let value = |tag: u8, v: f32| {
            let mut x = vec![0x0a, 8, 0x0a, 1, tag, 0x15];
            x.extend_from_slice(&v.to_le_bytes());
            x
        };
        assert_eq!(&two[11..13], &[0x2a, 20]);
        assert_eq!(&two[13..], [value(b'a', 1.0), value(b'b', 2.0)].concat());

        // session_log (field 7: 0x3A, 2) { status (0x08) START (1) }; field 6 is the
        // deprecated log_message
        let start = encode_event(1.5, 4, EventBody::SessionStart);
        assert_eq!(&start[9..], &[0x10, 4, 0x3a, 2, 0x08, 1]);
    }

    #[test]
    fn a_writer_appends_records_that_read_back_in_order() {
        let dir = std::env::temp_dir().join(format!("brigade-tensorboard-unit-{}", std::process::id()));
        let _scratch = crate::scratch::Scratch::absent(dir.clone());
        let mut w = EventWriter::create(&dir.join("run")).unwrap();
        w.add_scalars(3, &[(LOSS, 0.5)]).unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let bytes = std::fs::read(w.path()).unwrap();
        // every record: its length's CRC and its data's CRC check
        let mut at = 0;
        let mut events = vec![];
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let crc = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap());
            assert_eq!(crc(&bytes[at + 8..at + 12]), masked_crc32c(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(crc(&bytes[at + 12 + len..at + 16 + len]), masked_crc32c(data));
            events.push(data.to_vec());
            at += 16 + len;
        }
        assert_eq!(events.len(), 2);
        assert!(events[0].ends_with(b"brain.Event:2"));
        assert!(events[1].ends_with(&0.5f32.to_le_bytes()));
        // a second writer in the same second gets a file of its own
        let again = EventWriter::create(&dir.join("run")).unwrap();
        assert_ne!(again.path(), w.path());
    }

    #[test]
    fn a_run_directory_keeps_a_specs_characters_and_no_path() {
        let dir = Path::new("tb");
        assert_eq!(run_dir(dir, "powersgd:4@2"), dir.join("powersgd:4@2"));
        assert_eq!(run_dir(dir, "../a/b c"), dir.join(".._a_b_c"));
        assert_eq!(predicted_ms_tag(1.0, 20.0), "predicted/step_ms_1gbps_20us");
        assert_eq!(predicted_ms_tag(0.5, 2.5), "predicted/step_ms_0.5gbps_2.5us");
    }

    #[test]
    fn a_failed_write_is_kept_once_and_ends_the_writing() {
        // a directory that cannot be made: under a file
        let file = std::env::temp_dir().join(format!("brigade-tensorboard-file-{}", std::process::id()));
        let _scratch = crate::scratch::Scratch::absent(file.clone());
        std::fs::write(&file, b"x").unwrap();
        let tb = TensorBoard::new(file.join("run"));
        tb.add_scalars(0, &[(LOSS, 1.0)]);
        tb.add_scalars(1, &[(LOSS, 1.0)]);
        let e = tb.take_failure().expect("the directory cannot be made");
        assert!(e.to_string().contains("run"), "{e}");
        tb.add_scalars(2, &[(LOSS, 1.0)]);
        assert!(tb.take_failure().is_none(), "one failure, reported once");
        assert!(tb.event_file().is_none());
    }
}
