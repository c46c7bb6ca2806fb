//! NCCL bootstrap without a GPU: the unique id's bytes round-trip, and when rank 0 cannot
//! create the id (no libnccl or no driver), every rank gets a typed error instead of waiting.

use brigade_comm::nccl::{exchange_id, require_nccl, NcclId};
use brigade_comm::{run_on_threads, CommError};

#[test]
fn an_id_survives_its_128_bytes() {
    let bytes: [u8; 128] = std::array::from_fn(|i| (i * 7 + 200) as u8);
    assert_eq!(NcclId::from_bytes(&bytes).to_bytes(), bytes);
}

#[test]
fn without_nccl_every_rank_gets_an_error_and_none_waits_for_an_id() {
    let Err(missing) = require_nccl() else {
        eprintln!("SKIPPED without_nccl_every_rank_gets_an_error: libnccl and the driver load here");
        return;
    };
    let out = run_on_threads(3, |comm| exchange_id(&comm));
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.unwrap().unwrap_err();
        let CommError::Unavailable(text) = &e else {
            panic!("rank {rank}: {e:?}");
        };
        if rank == 0 {
            assert_eq!(e, missing);
            assert!(text.contains("libcuda.so.1") || text.contains("libnccl"), "{text}");
        } else {
            assert!(text.contains("rank 0 could not create the NCCL unique id"), "{text}");
        }
    }
}
