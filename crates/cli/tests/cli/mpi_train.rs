//! `brigade train --backend mpi` under `mpirun`: parity with the thread backend (mlp, gpt,
//! `--accum 2`), overlap in the recorded event order, a profile for the overlap model, setup errors on every
//! rank, and a killed rank.
//! Needs `mpirun` (Open MPI) on the PATH; built only with `--features mpi`.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use brigade_models::load_safetensors;

const BIN: &str = env!("CARGO_BIN_EXE_brigade");

fn mpirun(np: usize, args: &[&str]) -> Output {
    Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string(), BIN])
        .args(args)
        .output()
        .expect("mpirun must be on the PATH (apt-get install openmpi-bin)")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `name` in a directory the tests here share (each its own names), removed at exit.
fn tmp(name: &str) -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| crate::common::shared_dir("mpi-test")).join(name)
}

fn losses(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect()
}

/// Trains `flags` with 2 threads and with 2 MPI processes; returns the largest loss and
/// parameter differences (relative to max(1, |x|)).
fn parity(name: &str, flags: &[&str]) -> (f64, f64) {
    let files = |who: &str| {
        (
            tmp(&format!("{name}-{who}.csv")),
            tmp(&format!("{name}-{who}.safetensors")),
        )
    };
    let (tl, tp) = files("thread");
    let (ml, mp) = files("mpi");
    let run = |extra: &[&str], l: &Path, p: &Path| -> Vec<String> {
        let mut a: Vec<String> = flags.iter().chain(extra).map(|s| s.to_string()).collect();
        a.extend(
            [
                "--quiet",
                "--losses",
                l.to_str().unwrap(),
                "--save",
                p.to_str().unwrap(),
            ]
            .map(String::from),
        );
        a
    };
    let t = Command::new(BIN)
        .arg("train")
        .args(run(&["--world-size", "2"], &tl, &tp))
        .output()
        .unwrap();
    assert!(t.status.success(), "threads: {}", text(&t));
    let mut margs = vec!["train".to_string()];
    margs.extend(run(&["--backend", "mpi"], &ml, &mp));
    let m = mpirun(2, &margs.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(m.status.success(), "mpi: {}", text(&m));
    // Rank 0 alone prints the summary.
    assert_eq!(text(&m).matches("loss: first").count(), 1, "{}", text(&m));
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs().max(1.0);
    let (lt, lm) = (losses(&tl), losses(&ml));
    assert_eq!(lt.len(), lm.len());
    let dl = lt.iter().zip(&lm).map(|(a, b)| rel(*a, *b)).fold(0.0, f64::max);
    let (pt, pm) = (load_safetensors(&tp).unwrap(), load_safetensors(&mp).unwrap());
    assert_eq!(pt.len(), pm.len());
    let mut dp = 0.0f64;
    for ((nt, t), (nm, m)) in pt.iter().zip(&pm) {
        assert_eq!(nt, nm);
        for (a, b) in t.to_f64_vec().unwrap().iter().zip(m.to_f64_vec().unwrap()) {
            dp = dp.max(rel(*a, b));
        }
    }
    println!("{name}: max loss diff {dl:e}, max param diff {dp:e}");
    (dl, dp)
}

const MLP: &[&str] = &[
    "--model",
    "mlp",
    "--widths",
    "32,64,64,4",
    "--steps",
    "5",
    "--batch-size",
    "8",
    "--threads-per-rank",
    "1",
];
const GPT: &[&str] = &[
    "--model",
    "gpt",
    "--d-model",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--d-ff",
    "32",
    "--context",
    "8",
    "--steps",
    "3",
    "--batch-size",
    "2",
    "--threads-per-rank",
    "1",
];

#[test]
fn mpi_matches_threads_for_mlp_and_gpt_with_and_without_accumulation() {
    for (name, flags) in [("mlp", MLP), ("gpt", GPT)] {
        for accum in ["1", "2"] {
            let mut f = flags.to_vec();
            f.extend(["--accum", accum]);
            let (dl, dp) = parity(&format!("{name}-accum{accum}"), &f);
            assert!(
                dl <= 1e-6 && dp <= 1e-6,
                "{name} accum {accum}: losses {dl:e}, params {dp:e}"
            );
        }
    }
}

/// 3 steps of a 64-512-512-512-4 MLP on 2 MPI ranks, buckets of 0.5 MiB, and `extra`.
fn small_mlp_under_mpirun(extra: &[&str]) -> Output {
    small_mlp_steps_under_mpirun("3", extra)
}

/// `steps` steps of [`small_mlp_under_mpirun`]'s MLP.
fn small_mlp_steps_under_mpirun(steps: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "train",
        "--backend",
        "mpi",
        "--model",
        "mlp",
        "--widths",
        "64,512,512,512,4",
        "--steps",
        steps,
        "--batch-size",
        "64",
        "--bucket-mb",
        "0.5",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    mpirun(2, &args)
}

/// Every step of `brigade train --backend mpi` issues bucket 0 while backward still runs, on
/// every rank, as its profile records: the issue is the reducer's, before the last gradient
/// is computed, so the recorded order cannot miss it. When the comm stream then starts the
/// reduction is the scheduler's (mpirun binds a rank's compute thread and its comm worker to
/// one core), so it is not asked of a timed run: the library's test under mpirun
/// (`an_mpi_rank_reduces_bucket0_while_backward_still_runs` in crates/brigade) holds backward
/// until the start is recorded. With the buckets issued after the last gradient, this fails.
#[test]
fn the_first_bucket_is_reduced_while_backward_still_runs() {
    let p = tmp("overlap-profile.json");
    let out = small_mlp_steps_under_mpirun(
        "6",
        &[
            "--first-bucket-mb",
            "0.5",
            "--profile",
            p.to_str().unwrap(),
            "--profile-steps",
            "0..6",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let steps: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let steps = steps.as_array().expect("a list of step profiles");
    assert_eq!(steps.len(), 6);
    for (step, profile) in steps.iter().enumerate() {
        for rank in profile["ranks"].as_array().unwrap() {
            // Backward still runs until the last gradient (the first layer's) is final.
            let last_ready = rank["grad_ready_s"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            let launch = rank["buckets"][0]["launch_s"].as_f64().unwrap();
            assert!(
                launch < last_ready,
                "step {step}, rank {}: bucket 0 issued {:.0} us after the last gradient was ready",
                rank["rank"],
                (launch - last_ready) * 1e6
            );
        }
    }
}

/// mpirun binds a lone rank to one core of the host's (its default for -np <= 2): the run
/// says so once and how to get the rest; unbound, it says nothing.
#[test]
fn a_rank_bound_below_its_share_of_the_cores_is_told_so() {
    let run = |bind: &str| {
        Command::new("mpirun")
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "--bind-to",
                bind,
                "-np",
                "1",
                BIN,
            ])
            .args(["train", "--backend", "mpi", "--model", "mlp", "--widths", "8,8,2"])
            .args(["--steps", "1", "--batch-size", "2", "--quiet"])
            .output()
            .unwrap()
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bound = run("core");
    assert!(bound.status.success(), "{}", text(&bound));
    let t = text(&bound);
    if cpus > 1 {
        assert_eq!(
            t.matches("note: mpirun bound this rank to 1 core of the").count(),
            1,
            "{t}"
        );
        assert!(t.contains("--bind-to none"), "{t}");
    }
    let free = run("none");
    assert!(free.status.success(), "{}", text(&free));
    assert!(!text(&free).contains("mpirun bound"), "{}", text(&free));
}

#[test]
fn setup_errors_fail_every_rank_with_the_same_message() {
    let out = mpirun(2, &["train", "--backend", "mpi", "--world-size", "3", "--steps", "1"]);
    assert!(!out.status.success());
    assert_eq!(
        text(&out).matches("--world-size 3 but mpirun started 2").count(),
        2,
        "{}",
        text(&out)
    );
    // A file missing on rank 1 only (MPMD launch: each rank gets its own flags).
    let init = tmp("init.safetensors");
    let made = Command::new(BIN)
        .args([
            "train",
            "--model",
            "mlp",
            "--widths",
            "8,8,2",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--quiet",
        ])
        .args(["--save", init.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", text(&made));
    let common = [
        "train",
        "--backend",
        "mpi",
        "--model",
        "mlp",
        "--widths",
        "8,8,2",
        "--steps",
        "2",
        "--batch-size",
        "2",
    ];
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "1", BIN])
        .args(common)
        .args(["--init", init.to_str().unwrap()])
        .args([":", "-np", "1", BIN])
        .args(common)
        .args(["--init", "/nonexistent/init.safetensors"])
        .output()
        .unwrap();
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("setup failed on this rank of 2"), "{t}");
    assert!(t.contains("setup failed on rank 1 of 2"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
}

#[test]
fn killing_one_rank_ends_the_job_with_an_error_within_the_timeout() {
    let mut job = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", BIN])
        .args([
            "train",
            "--backend",
            "mpi",
            "--model",
            "mlp",
            "--widths",
            "32,64,4",
            "--steps",
            "100000000",
            "--batch-size",
            "8",
        ])
        .args(["--quiet", "--timeout-s", "20"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    // Read stderr as it comes (a full pipe would stall the job).
    let mut stderr = job.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    // Find both ranks: processes started by this mpirun whose environment names their rank.
    let start = Instant::now();
    let (survivor, victim) = loop {
        assert!(start.elapsed() < Duration::from_secs(20), "the ranks never appeared");
        if let (Some(r0), Some(r1)) = (find_rank(job.id(), 0), find_rank(job.id(), 1)) {
            break (r0, r1);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(1000)); // well into training
    assert!(job.try_wait().unwrap().is_none(), "the job ended before the kill");
    // (the check at the end can see a live rank 0: it is running now)
    assert!(
        alive(survivor),
        "rank 0 (pid {survivor}) is not running before the kill"
    );
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap()
        .success());
    let status = loop {
        if let Some(status) = job.try_wait().unwrap() {
            break status;
        }
        if killed.elapsed() > Duration::from_secs(20) {
            let _ = job.kill();
            panic!("mpirun still running 20 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = killed.elapsed();
    let stderr = reader.join().unwrap();
    println!("rank 1 killed: mpirun exited with {status} after {took:?}; its stderr:\n{stderr}");
    assert!(!status.success(), "{stderr}");
    // The error names the dead rank (whoever noticed first: mpirun or rank 0).
    assert!(
        stderr.contains("rank 1 "),
        "stderr does not name the killed rank 1:\n{stderr}"
    );
    // Rank 0 is gone too. Its pid was found while the job ran: once mpirun exits, rank 0 is
    // no longer mpirun's child, so looking it up among mpirun's children finds nothing.
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(survivor) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(survivor), "rank 0 (pid {survivor}) outlived the job");
}

/// Whether process `pid` exists and has not ended (a zombie has).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_string));
    !matches!(state.as_deref(), None | Some("Z") | Some("X"))
}

/// The pid of the process of `rank` among the children of `parent`.
fn find_rank(parent: u32, rank: usize) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if env
            .split(|&b| b == 0)
            .any(|kv| kv == format!("OMPI_COMM_WORLD_RANK={rank}").as_bytes())
        {
            return Some(pid);
        }
    }
    None
}

#[test]
fn dropout_resumes_exactly_under_mpirun() {
    // 2 steps + --resume + 2 steps against 4 straight, two MPI processes at --dropout 0.3:
    // each process's generator goes through the checkpoint (gathered on rank 0, each rank
    // reading its own back); the same loss rows and parameters bit for bit
    let flags = without_steps(MLP);
    let run = |extra: &[&str]| {
        let mut a = vec!["train", "--backend", "mpi", "--quiet", "--dropout", "0.3"];
        a.extend(&flags);
        a.extend(extra);
        let out = mpirun(2, &a);
        assert!(out.status.success(), "{a:?}: {}", text(&out));
    };
    let (la, pa, ck, lb, pb) = (
        tmp("dropout-a.csv"),
        tmp("dropout-a.safetensors"),
        tmp("dropout.ckpt"),
        tmp("dropout-b.csv"),
        tmp("dropout-b.safetensors"),
    );
    let p = |x: &Path| x.to_str().unwrap().to_string();
    run(&["--steps", "4", "--losses", &p(&la), "--save", &p(&pa)]);
    run(&["--steps", "2", "--checkpoint", &p(&ck)]);
    run(&[
        "--steps",
        "4",
        "--resume",
        &p(&ck),
        "--losses",
        &p(&lb),
        "--save",
        &p(&pb),
    ]);
    let rows = |f: &Path| -> Vec<String> {
        std::fs::read_to_string(f)
            .unwrap()
            .lines()
            .skip(1)
            .map(String::from)
            .collect()
    };
    assert_eq!(rows(&lb), rows(&la)[2..]);
    let bits = |f: &Path| -> Vec<(String, Vec<u32>)> {
        load_safetensors(f)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()))
            .collect()
    };
    assert!(bits(&pb) == bits(&pa), "parameters, bit for bit");
}

/// `flags` without `--steps` and its value.
fn without_steps<'a>(flags: &[&'a str]) -> Vec<&'a str> {
    let i = flags.iter().position(|f| *f == "--steps").unwrap();
    [&flags[..i], &flags[i + 2..]].concat()
}

#[test]
fn uneven_per_rank_files_join_under_mpi_as_under_threads() {
    // a file per rank of different lengths: rank 0 holds 5 steps of 8 rows, rank 1 holds 3 and
    // joins at step 3; the MPI processes train as the threads do
    use brigade_tensor::{DType, Rng, Tensor};
    for (rank, rows) in [(0usize, 40usize), (1, 24)] {
        let mut rng = Rng::new(30 + rank as u64);
        let x = Tensor::randn(&[rows, 32], 1.0, DType::F32, &mut rng);
        let y: Vec<i64> = (0..rows).map(|i| ((i * 7 + rank) % 4) as i64).collect();
        let y = Tensor::from_vec(y, &[rows]).unwrap();
        let path = tmp(&format!("join-shard-{rank}.safetensors"));
        brigade_models::save_safetensors(&path, &[("inputs".into(), x), ("targets".into(), y)], None).unwrap();
    }
    let pattern = tmp("join-shard-{rank}.safetensors");
    for mode in ["divide-initial", "divide-active"] {
        let mut f = MLP.to_vec();
        f.extend([
            "--data",
            pattern.to_str().unwrap(),
            "--join",
            mode,
            "--optimizer",
            "sgd",
        ]);
        let (dl, dp) = parity(&format!("join-{mode}"), &f);
        assert!(dl <= 1e-6 && dp <= 1e-6, "{mode}: losses {dl:e}, params {dp:e}");
    }
}

/// A profile recorded under mpirun (the buckets through the node's shared segment) feeds the
/// overlap model like a thread one: `predict --measured-link` at the recorded cap regroups the
/// buckets the run had and replays each on one link, the least-squares line of the recorded
/// buckets' times against their sizes (latency and per-byte cost both non-negative). How close
/// that line's times come to a fresh run's is a measurement, not a test: `mpi-own-link` in
/// scripts/predict-validation.py.
#[test]
fn an_mpi_profile_predicts_its_own_buckets_on_the_measured_link() {
    let p = tmp("profile.json");
    let out = small_mlp_under_mpirun(&["--profile", p.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(v["world_size"], 2);
    let predict = Command::new(BIN)
        .args([
            "predict",
            "--profile",
            p.to_str().unwrap(),
            "--json",
            "--bucket-mb",
            "0.5",
        ])
        .arg("--measured-link")
        .output()
        .unwrap();
    assert!(predict.status.success(), "{}", text(&predict));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&predict.stdout).unwrap();
    // (parameters, bytes, time on the link) of each bucket, recorded and replayed
    let buckets = |list: &serde_json::Value| -> Vec<(serde_json::Value, f64, f64)> {
        list.as_array()
            .unwrap()
            .iter()
            .map(|b| {
                let t = |k: &str| b[k].as_f64().unwrap();
                (b["params"].clone(), t("bytes"), t("finish_s") - t("start_s"))
            })
            .collect()
    };
    let replayed = buckets(&rows[0]["buckets"]);
    // a recorded bucket's time on the link is its collective's (`link_s`); the rest of its span
    // (the copy back into the gradients) is compute, which the replay charges at the recorded
    // rate per byte beside the link's time
    let spans = buckets(&v["ranks"][0]["buckets"]);
    let recorded: Vec<_> = spans
        .iter()
        .zip(v["ranks"][0]["buckets"].as_array().unwrap())
        .map(|((params, bytes, _), b)| (params.clone(), *bytes, b["link_s"].as_f64().unwrap()))
        .collect();
    let copy_per_byte =
        spans.iter().zip(&recorded).map(|(s, r)| s.2 - r.2).sum::<f64>() / recorded.iter().map(|r| r.1).sum::<f64>();
    // 64,512,512,512,4 in 0.5 MiB buckets: the head's weight and bias with layers.2's weight,
    // layers.2's bias with layers.1's weight, then the rest: three buckets of different sizes
    assert_eq!(recorded.len(), 3, "{recorded:?}");
    let groups = |b: &[(serde_json::Value, f64, f64)]| b.iter().map(|b| (b.0.clone(), b.1)).collect::<Vec<_>>();
    assert_eq!(groups(&replayed), groups(&recorded));
    // one line t = a + b x bytes through every replayed bucket, a and b non-negative
    let ((_, x0, t0), (_, x2, t2)) = (&replayed[0], &replayed[2]);
    let slope = (t0 - t2) / (x0 - x2);
    let intercept = t2 - slope * x2;
    assert!(
        slope >= 0.0 && intercept >= -1e-15,
        "a = {intercept} s, b = {slope} s/byte"
    );
    for (_, x, t) in &replayed {
        assert!((t - (intercept + slope * x)).abs() <= 1e-12, "{replayed:?}");
    }
    // and that line, less the copy, is the recorded link times' least squares: its residuals
    // are orthogonal to the sizes (the normal equation of the slope, which holds with or without an intercept)
    let weighted: f64 = recorded
        .iter()
        .zip(&replayed)
        .map(|((_, x, y), (_, _, t))| x * (y - (t - copy_per_byte * x)))
        .sum();
    let scale: f64 = recorded.iter().map(|(_, x, y)| x * y).sum();
    assert!(
        weighted.abs() <= 1e-9 * scale,
        "sum of x (recorded - replayed) = {weighted}"
    );
    assert!(rows[0]["predicted_step_s"].as_f64().unwrap() >= rows[0]["compute_step_s"].as_f64().unwrap());
}

/// The binary installs the shared heap's allocator: under mpirun on one host its collectives'
/// buffers (the bench's, as DDP's buckets) are reduced in place in the ranks' shared heaps.
#[test]
fn the_binary_reduces_its_buffers_in_place_in_the_shared_heaps() {
    let args = ["bench", "comm", "--backend", "mpi", "--sizes", "1M", "--iters", "5"];
    let out = mpirun(2, &args);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("backend mpi (shared memory, in place)"),
        "{}",
        text(&out)
    );
}
