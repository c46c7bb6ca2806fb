//! The one list of policies: every built-in entry names, reads, writes and builds its policy,
//! and a registry reads a user's policies by name beside them.

use brigade_ddp::ReducerPolicy;
use brigade_policies::registry::{forms, plan_candidates, planned_names, BUILT_IN};
use brigade_policies::{AllReduce, PolicySpec, Registry};

#[test]
fn every_built_in_entry_reads_writes_and_builds_its_policy() {
    assert_eq!(BUILT_IN.len(), 12);
    for e in &BUILT_IN {
        // the form with a sample argument where it takes one
        let spec_text = match (e.name, e.args) {
            (_, "") => e.name.to_string(),
            (_, "RATIO") => format!("{}:0.25", e.name),
            ("diloco", _) => "diloco:3:0.5".to_string(),
            ("streaming-diloco", _) => "streaming-diloco:3:2:2".to_string(),
            ("zero3", _) => "zero3:qwz:qgz".to_string(),
            _ => format!("{}:3@2", e.name),
        };
        let spec: PolicySpec = spec_text.parse().unwrap();
        assert_eq!(spec.to_string(), spec_text);
        assert_eq!(spec.name(), e.name);
        assert!(spec.is_built_in());
        let built = spec.build(&Registry::new()).unwrap();
        assert_eq!(built.name(), spec_text, "the built policy names itself as its spec");
        assert!(forms().contains(&e.form()), "{}", forms());
        // a plan weighs it exactly when its entry says so
        assert_eq!(spec.plan_family().is_some(), e.planned, "{spec_text}");
    }
    assert_eq!(
        planned_names(),
        "allreduce, fp16, bf16, powersgd, topk, efsign, zero1, zero2, zero3, diloco and streaming-diloco"
    );
    // what a plan weighs: each planned entry once, PowerSGD at each recorded rank (rank 1 when
    // none was recorded)
    let none = plan_candidates(&[]);
    assert_eq!(
        none.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        [
            "allreduce",
            "fp16",
            "bf16",
            "powersgd:1",
            "topk:0.01",
            "efsign",
            "zero1",
            "zero2",
            "zero3",
            "diloco:10",
            "streaming-diloco:10:2"
        ]
    );
    let recorded: Vec<PolicySpec> = ["powersgd:4", "powersgd:2", "powersgd:4", "int8"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    let some: Vec<String> = plan_candidates(&recorded).iter().map(|p| p.to_string()).collect();
    assert_eq!(
        some,
        [
            "allreduce",
            "fp16",
            "bf16",
            "powersgd:2",
            "powersgd:4",
            "topk:0.01",
            "efsign",
            "zero1",
            "zero2",
            "zero3",
            "diloco:10",
            "streaming-diloco:10:2"
        ]
    );
    // the family drops PowerSGD's start, keeps its rank
    let f = |s: &str| s.parse::<PolicySpec>().unwrap().plan_family().unwrap().to_string();
    assert_eq!(f("powersgd:4@0"), "powersgd:4");
}

#[test]
fn a_spec_writes_a_tiny_or_huge_number_in_exponent_form_and_reads_it_back() {
    // 1e-30 in Rust's plain form is 32 characters (a directory name per policy holds the spec)
    for (typed, written) in [
        ("topk:1e-30", "topk:1e-30"),
        ("topk:0.001", "topk:0.001"),
        ("topk:0.00012", "topk:0.00012"),
        ("topk:0.000012345", "topk:1.2345e-5"),
        ("diloco:2:1e30", "diloco:2:1e30"),
        ("diloco:2:0.5:1e-20", "diloco:2:0.5:1e-20"),
        ("streaming-diloco:4:2:1:3e-25", "streaming-diloco:4:2:1:3e-25"),
    ] {
        let spec: PolicySpec = typed.parse().unwrap();
        assert_eq!(spec.to_string(), written);
        assert_eq!(written.parse::<PolicySpec>().unwrap(), spec);
    }
}

#[test]
fn a_registry_reads_its_users_policies_and_lists_them_in_help_and_errors() {
    let mut r = Registry::new();
    r.register_about("mean", "an averaging all-reduce", |_| {
        Ok(Box::new(AllReduce) as Box<dyn ReducerPolicy>)
    })
    .unwrap();
    assert_eq!(r.parse("mean:2").unwrap().to_string(), "mean:2");
    assert_eq!(r.parse("zero2").unwrap(), PolicySpec::Zero2);
    let e = r.parse("median").unwrap_err().to_string();
    assert!(
        e.contains("unknown policy 'median'") && e.contains("registered: mean"),
        "{e}"
    );
    assert!(e.contains("powersgd:R[@START]") && e.contains("int8"), "{e}");
    assert!(
        r.forms()
            .ends_with("streaming-diloco:H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8], mean[:ARGS]"),
        "{}",
        r.forms()
    );
    let help = r.help();
    assert_eq!(help.len(), 13);
    assert_eq!(help[12], "mean[:ARGS]: an averaging all-reduce");
    // without the user's registry the name is unknown
    assert!(Registry::new().parse("mean").is_err());
}
