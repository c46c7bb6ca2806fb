//! The one list of Brigade's policies: every built-in policy is an [`Entry`] of [`BUILT_IN`],
//! which names it, reads and writes its spec, says it in help and errors, and builds it; a
//! [`Registry`] adds a library user's own policies by name. Adding a built-in policy is its
//! file, its [`PolicySpec`] variant and one entry here.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use brigade_ddp::ReducerPolicy;

use crate::error::{PolicyError, Result};
use crate::spec::{spec_error, PolicySpec};
use crate::{
    diloco, powersgd, streaming_diloco, topk, AllReduce, Compress, EfSign, HalfType, Int8, Zero, Zero3, ZeroPlusPlus,
    ZeroStage,
};

/// How an entry's spec is written: its name alone, or its name and an argument.
enum Form {
    /// `NAME`: the one spec.
    Plain(PolicySpec),
    /// `NAME:ARGS`.
    Args {
        /// The spec of `NAME:ARGS` from `ARGS` (`None`: the name alone); `spec` is the whole
        /// spec, for the error.
        read: fn(spec: &str, args: Option<&str>) -> Result<PolicySpec>,
        /// `ARGS` of `spec` when it is this entry's.
        write: fn(&PolicySpec) -> Option<String>,
        /// The spec a plan groups `spec` under: its settings that change what a step measures.
        family: fn(&PolicySpec) -> PolicySpec,
        /// What a plan tries when no profile recorded this entry.
        plan_default: fn() -> PolicySpec,
    },
}

/// One built-in policy.
pub struct Entry {
    /// The name its spec starts with.
    pub name: &'static str,
    /// What follows `NAME:` (`R[@START]`); empty for a policy that takes no argument.
    pub args: &'static str,
    /// What it does, in one line (for `--help`).
    pub about: &'static str,
    /// Whether a plan weighs it (the memory model and the overlap model know it).
    pub planned: bool,
    form: Form,
    build: fn(&PolicySpec) -> Result<Box<dyn ReducerPolicy>>,
}

impl Entry {
    const fn plain(
        name: &'static str,
        about: &'static str,
        planned: bool,
        spec: PolicySpec,
        build: fn(&PolicySpec) -> Result<Box<dyn ReducerPolicy>>,
    ) -> Entry {
        Entry {
            name,
            args: "",
            about,
            planned,
            form: Form::Plain(spec),
            build,
        }
    }

    /// The spec's form for help and errors: `NAME` or `NAME:ARGS`.
    pub fn form(&self) -> String {
        match self.args {
            "" => self.name.to_string(),
            args => format!("{}:{args}", self.name),
        }
    }

    /// The spec `NAME[:ARGS]` names (`spec` is the whole spec, for the error).
    fn read(&self, spec: &str, args: Option<&str>) -> Result<PolicySpec> {
        match (&self.form, args) {
            (Form::Plain(p), None) => Ok(p.clone()),
            (Form::Plain(_), Some(_)) => Err(spec_error(
                spec,
                format!("'{}' takes no argument (the forms: {})", self.name, forms()),
            )),
            (Form::Args { read, .. }, args) => read(spec, args),
        }
    }

    /// `Some(ARGS)` (`None` for no argument) when `spec` is this entry's.
    fn write(&self, spec: &PolicySpec) -> Option<Option<String>> {
        match &self.form {
            Form::Plain(p) => (p == spec).then_some(None),
            // an empty argument: the name alone
            Form::Args { write, .. } => write(spec).map(|a| (!a.is_empty()).then_some(a)),
        }
    }
}

/// Every built-in policy, in the order help and errors list them.
pub static BUILT_IN: [Entry; 12] = [
    Entry::plain(
        "allreduce",
        "one f32 all-reduce averaging each bucket",
        true,
        PolicySpec::AllReduce,
        |_| Ok(Box::new(AllReduce)),
    ),
    Entry::plain(
        "fp16",
        "divide, round to fp16, all-reduce half the bytes, widen",
        true,
        PolicySpec::Fp16,
        |_| Ok(Box::new(Compress::new(HalfType::F16))),
    ),
    Entry::plain(
        "bf16",
        "divide, round to bf16, all-reduce half the bytes, widen",
        true,
        PolicySpec::Bf16,
        |_| Ok(Box::new(Compress::new(HalfType::BF16))),
    ),
    Entry::plain(
        "int8",
        "quantize to int8 with error feedback, all-gather a quarter of the bytes",
        false,
        PolicySpec::Int8,
        |_| Ok(Box::new(Int8::default())),
    ),
    Entry {
        name: "powersgd",
        args: "R[@START]",
        about: "low-rank (rank R) with error feedback and warm start, from iteration START; two all-reduces a bucket",
        planned: true,
        form: Form::Args {
            read: powersgd::read_spec,
            write: powersgd::write_spec,
            family: powersgd::family,
            plan_default: powersgd::plan_default,
        },
        build: powersgd::build_spec,
    },
    Entry {
        name: "topk",
        args: "RATIO",
        about: "top-k (the fraction RATIO of each bucket) with error feedback, values and indices all-gathered",
        planned: true,
        form: Form::Args {
            read: topk::read_spec,
            write: topk::write_spec,
            family: |s| s.clone(),
            plan_default: || PolicySpec::TopK {
                ratio: crate::spec::Ratio(0.01),
            },
        },
        build: topk::build_spec,
    },
    Entry::plain(
        "efsign",
        "EF-SignSGD: one bit per element and a scale per bucket, with error feedback, all-gathered (for SGD: trains poorly under Adam/AdamW)",
        true,
        PolicySpec::EfSign,
        |_| Ok(Box::new(EfSign::default())),
    ),
    Entry::plain(
        "zero1",
        "ZeRO-1: optimizer state sharded over the ranks",
        true,
        PolicySpec::Zero1,
        |_| Ok(Box::new(Zero::new(ZeroStage::One)?)),
    ),
    Entry::plain(
        "zero2",
        "ZeRO-2: optimizer state and gradients sharded",
        true,
        PolicySpec::Zero2,
        |_| Ok(Box::new(Zero::new(ZeroStage::Two)?)),
    ),
    Entry {
        name: "zero3",
        args: "[qwz][:qgz]",
        about: "ZeRO-3: parameters sharded too, gathered per unit; ZeRO++'s int8 gathers (qwz), int8 gradients (qgz)",
        planned: true,
        form: Form::Args {
            read: ZeroPlusPlus::read,
            write: ZeroPlusPlus::write,
            family: |s| s.clone(),
            plan_default: || PolicySpec::Zero3,
        },
        build: |s| {
            let options = match s {
                PolicySpec::Zero3Quantized(o) => *o,
                _ => ZeroPlusPlus::default(),
            };
            Ok(Box::new(Zero3::new().with_options(options)))
        },
    },
    Entry {
        name: "diloco",
        args: "H[:OUTER_LR[:MOMENTUM]]",
        about: "DiLoCo: H local steps, then the averaged pseudo-gradient through outer Nesterov SGD (0.7, 0.9)",
        planned: true,
        form: Form::Args {
            read: diloco::read_spec,
            write: diloco::write_spec,
            family: diloco::family,
            plan_default: diloco::plan_default,
        },
        build: diloco::build_spec,
    },
    Entry {
        name: "streaming-diloco",
        args: "H:FRAGMENTS[:DELAY[:OUTER_LR[:MOMENTUM]]][:bf16|:int8]",
        about: "streaming DiLoCo: fragments synced on a staggered schedule, each overlapping DELAY (1) local steps; outer gradients in f32, bf16 or int8",
        planned: true,
        form: Form::Args {
            read: streaming_diloco::read_spec,
            write: streaming_diloco::write_spec,
            family: streaming_diloco::family,
            plan_default: streaming_diloco::plan_default,
        },
        build: streaming_diloco::build_spec,
    },
];

/// The built-in entry named `name`.
pub fn entry(name: &str) -> Option<&'static Entry> {
    BUILT_IN.iter().find(|e| e.name == name)
}

/// The built-in entry `spec` is of (`None` for a user policy), with its argument.
pub(crate) fn entry_of(spec: &PolicySpec) -> Option<(&'static Entry, Option<String>)> {
    BUILT_IN.iter().find_map(|e| e.write(spec).map(|a| (e, a)))
}

/// `spec` read by its entry; `None` when no built-in policy has its name.
pub(crate) fn read_built_in(spec: &str, name: &str, args: Option<&str>) -> Option<Result<PolicySpec>> {
    entry(name).map(|e| e.read(spec, args))
}

/// Every built-in form, then a user policy's: for errors.
pub fn forms() -> String {
    let forms: Vec<String> = BUILT_IN.iter().map(Entry::form).collect();
    format!("{}, or a registered NAME[:ARGS]", forms.join(", "))
}

/// The spec a plan groups `spec`'s profiles under (`None`: a plan does not weigh it).
pub(crate) fn plan_family(spec: &PolicySpec) -> Option<PolicySpec> {
    let (e, _) = entry_of(spec).filter(|(e, _)| e.planned)?;
    Some(match &e.form {
        Form::Plain(p) => p.clone(),
        Form::Args { family, .. } => family(spec),
    })
}

/// The policies a plan weighs, given the policies its profiles recorded: each planned entry's
/// spec, and for an entry with an argument every recorded spec of it (sorted), or its default
/// when none was recorded.
pub fn plan_candidates(recorded: &[PolicySpec]) -> Vec<PolicySpec> {
    let mut out = vec![];
    for e in BUILT_IN.iter().filter(|e| e.planned) {
        match &e.form {
            Form::Plain(p) => out.push(p.clone()),
            Form::Args { plan_default, .. } => {
                let mut mine: Vec<PolicySpec> = recorded
                    .iter()
                    .filter(|s| entry_of(s).is_some_and(|(x, _)| std::ptr::eq(x, e)))
                    .cloned()
                    .collect();
                mine.sort();
                mine.dedup();
                if mine.is_empty() {
                    mine.push(plan_default());
                }
                out.extend(mine);
            }
        }
    }
    out
}

/// The names of the policies a plan weighs, for errors: `a, b and c`.
pub fn planned_names() -> String {
    let names: Vec<&str> = BUILT_IN.iter().filter(|e| e.planned).map(|e| e.name).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

/// Builds a built-in spec.
pub(crate) fn build_built_in(spec: &PolicySpec) -> Option<Result<Box<dyn ReducerPolicy>>> {
    entry_of(spec).map(|(e, _)| (e.build)(spec))
}

/// Names a user policy may take: a letter, then letters, digits, `_` or `-`.
pub(crate) fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Makes one rank's instance of a registered user policy from the spec's argument.
pub type MakeUserPolicy = Arc<dyn Fn(Option<&str>) -> Result<Box<dyn ReducerPolicy>> + Send + Sync>;

/// The built-in policies and a library user's own, by name, so that a [`PolicySpec`] (from a
/// command line, a sweep, a checkpoint) can name user policies like the built-in ones. Cheap
/// to clone.
#[derive(Clone, Default)]
pub struct Registry {
    makers: BTreeMap<String, (MakeUserPolicy, String)>,
}

impl Registry {
    /// The built-in policies alone.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `make` under `name` (a letter, then letters, digits, `_`, `-`; not a built-in
    /// name, not taken).
    pub fn register(
        &mut self,
        name: &str,
        make: impl Fn(Option<&str>) -> Result<Box<dyn ReducerPolicy>> + Send + Sync + 'static,
    ) -> Result<()> {
        self.register_about(name, "", make)
    }

    /// [`Registry::register`] with a line saying what the policy does, for help.
    pub fn register_about(
        &mut self,
        name: &str,
        about: &str,
        make: impl Fn(Option<&str>) -> Result<Box<dyn ReducerPolicy>> + Send + Sync + 'static,
    ) -> Result<()> {
        if !valid_name(name) {
            return Err(spec_error(
                name,
                "a policy name is a letter, then letters, digits, '_' or '-'",
            ));
        }
        if entry(name).is_some() || self.makers.contains_key(name) {
            return Err(PolicyError::Taken(name.to_string()));
        }
        self.makers
            .insert(name.to_string(), (Arc::new(make), about.to_string()));
        Ok(())
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.makers.keys().cloned().collect()
    }

    /// `s` as a spec naming a built-in or a registered policy (an unregistered user name is
    /// an error listing what is known).
    pub fn parse(&self, s: &str) -> Result<PolicySpec> {
        let spec: PolicySpec = s.parse()?;
        match &spec {
            PolicySpec::User { name, .. } if !self.makers.contains_key(name) => Err(self.unknown(name)),
            _ => Ok(spec),
        }
    }

    /// Every form a spec takes here: the built-in ones, then the registered names.
    pub fn forms(&self) -> String {
        let mut forms: Vec<String> = BUILT_IN.iter().map(Entry::form).collect();
        forms.extend(self.makers.keys().map(|n| format!("{n}[:ARGS]")));
        forms.join(", ")
    }

    /// One line per policy, `FORM: what it does`, for help.
    pub fn help(&self) -> Vec<String> {
        let built_in = BUILT_IN.iter().map(|e| format!("{}: {}", e.form(), e.about));
        let user = self.makers.iter().map(|(n, (_, about))| match about.as_str() {
            "" => format!("{n}[:ARGS]: a registered policy"),
            a => format!("{n}[:ARGS]: {a}"),
        });
        built_in.chain(user).collect()
    }

    fn unknown(&self, name: &str) -> PolicyError {
        let forms: Vec<String> = BUILT_IN.iter().map(Entry::form).collect();
        PolicyError::Unknown {
            name: name.to_string(),
            built_in: forms.join(", "),
            registered: if self.makers.is_empty() {
                String::new()
            } else {
                format!("; registered: {}", self.names().join(", "))
            },
        }
    }

    pub(crate) fn make(&self, name: &str, arg: Option<&str>) -> Result<Box<dyn ReducerPolicy>> {
        match self.makers.get(name) {
            Some((make, _)) => make(arg),
            None => Err(self.unknown(name)),
        }
    }
}

impl PolicySpec {
    /// The policy's name: the spec without its argument.
    pub fn name(&self) -> &str {
        match self {
            PolicySpec::User { name, .. } => name,
            _ => entry_of(self).map_or("", |(e, _)| e.name),
        }
    }

    /// The spec's form (`NAME:ARGS`, where the outer lr goes) when the policy steps an outer
    /// optimizer of its own (DiLoCo's, a streaming DiLoCo's), whose lr a divergence can be
    /// lowered in as well as `--lr`; `None` otherwise.
    pub fn outer_lr_form(&self) -> Option<String> {
        match self {
            PolicySpec::Diloco(_) | PolicySpec::StreamingDiloco(_) => entry_of(self).map(|(e, _)| e.form()),
            _ => None,
        }
    }

    /// The spec a plan groups this one's profiles under (the settings that change what a step
    /// measures, PowerSGD's rank but not its start); `None` for a policy a plan does not weigh.
    pub fn plan_family(&self) -> Option<PolicySpec> {
        plan_family(self)
    }

    /// A new policy of this kind for one rank (a policy holds one rank's state); user policies
    /// are made by `registry`.
    pub fn build(&self, registry: &Registry) -> Result<Box<dyn ReducerPolicy>> {
        match self {
            PolicySpec::User { name, arg } => registry.make(name, arg.as_deref()),
            _ => build_built_in(self).expect("every built-in spec has its entry"),
        }
    }

    /// `s` read with PowerSGD's settings given apart ([`POWERSGD_SETTINGS`](powersgd::POWERSGD_SETTINGS)): a bare
    /// `powersgd` is of rank `rank`, and a PowerSGD spec without `@START` starts at `start_iter`.
    pub fn parse_with_settings(s: &str, rank: usize, start_iter: usize) -> Result<PolicySpec> {
        // a bare name is of the settings as given: PowerSgdConfig::validate says what is wrong
        let spec = match s.split_once(':') {
            None if s == "powersgd" => PolicySpec::PowerSgd { rank, start_iter },
            _ => s.parse()?,
        };
        Ok(match spec {
            PolicySpec::PowerSgd { rank, .. } if !s.contains('@') => PolicySpec::PowerSgd { rank, start_iter },
            spec => spec,
        })
    }
}

impl fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, arg) = match self {
            PolicySpec::User { name, arg } => (name.as_str(), arg.clone()),
            _ => entry_of(self)
                .map(|(e, a)| (e.name, a))
                .expect("every built-in spec has its entry"),
        };
        match arg {
            None => f.write_str(name),
            Some(a) => write!(f, "{name}:{a}"),
        }
    }
}

impl FromStr for PolicySpec {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        match read_built_in(s, name, arg) {
            Some(spec) => spec,
            None if valid_name(name) => Ok(PolicySpec::User {
                name: name.to_string(),
                arg: arg.map(str::to_string),
            }),
            None => Err(spec_error(s, format!("not a policy name (the forms: {})", forms()))),
        }
    }
}
