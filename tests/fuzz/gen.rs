//! Random well-typed models in Tessera's model DSL, for the differential fuzzer.
//!
//! A program is a block `Replicated -> Replicated` drawn from the DSL's
//! grammar (every primitive layer and role, every elementwise function,
//! every collective, residuals, reuse of a layer and of a value, nested
//! blocks and stacks of them, dropout, `#[recompute]`, `#[precision]`,
//! `#[tied]`), inside a small language model that stacks it as its pipeline
//! split field. Everything is well typed by construction: the generator
//! tracks each value's layout (and width) and only applies what the DSL
//! accepts, and every value and layer it creates is used, as the DSL
//! requires. The build script writes the programs out as Rust; the test
//! compiles them and checks each against one rank and finite differences.

/// SplitMix64: small, seedable, and the same on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// The model width, the MLP width, and attention's packed widths: 4 query and
/// 4 key/value heads of 2, so every degree up to 4 splits whole heads.
const D: usize = 8;
const HID: usize = 16;
const QKV: usize = 24;
const ATT: usize = 8;

/// What a value is: its layout, and for `SplitHidden` which width it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    R,
    P,
    S,
    H(Width),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Width {
    Hid,
    Qkv,
    Att,
}

impl Width {
    fn size(self) -> usize {
        match self {
            Width::Hid => HID,
            Width::Qkv => QKV,
            Width::Att => ATT,
        }
    }
}

/// What a field does, for reusing it on another value.
#[derive(Clone, Debug, PartialEq)]
enum Role {
    /// `Replicated -> Replicated` (norms, plain linear maps, dropout, position table, MoE, nested blocks).
    RtoR,
    /// A nested block `Replicated -> PartialSum`.
    RtoP,
    Column(Width),
    Row(Width),
    Attention,
}

struct Field {
    name: String,
    ty: String,
    ctor: String,
    attrs: Vec<String>,
    role: Role,
    /// Whether `#[recompute]` / `#[recompute(selective)]` / `#[tied]` may go on it.
    recomputable: bool,
    selective: bool,
    tie_group: Option<String>,
}

struct Val {
    var: String,
    kind: Kind,
    uses: usize,
}

/// One generated block: a struct of layers and its forward body.
pub struct Block {
    pub name: String,
    fields: Vec<Field>,
    lets: Vec<String>,
    output: String,
    out: Kind,
}

impl Block {
    fn source(&self) -> String {
        let fields: Vec<String> =
            self.fields.iter().map(|f| format!("    {}{}: {},", f.attrs.iter().map(|a| format!("{a} ")).collect::<String>(), f.name, f.ty)).collect();
        let ctor: Vec<String> = self.fields.iter().map(|f| format!("            {}: {},", f.name, f.ctor)).collect();
        let out = if self.out == Kind::P { "PartialSum" } else { "Replicated" };
        format!(
            "#[derive(Module)]\npub struct {name} {{\n{fields}\n}}\n\n#[forward]\nimpl {name} {{\n    fn forward(&self, x: Act<Replicated>) -> Act<{out}> {{\n{lets}        {output}\n    }}\n}}\n\nimpl {name} {{\n    pub fn new() -> Result<{name}> {{\n        Ok({name} {{\n{ctor}\n        }})\n    }}\n}}\n",
            name = self.name,
            fields = fields.join("\n"),
            lets = self.lets.iter().map(|l| format!("        {l}\n")).collect::<String>(),
            output = self.output,
            ctor = ctor.join("\n"),
        )
    }
}

/// A generated program: its blocks (nested ones first), the language model
/// around them, and what the test needs to know about it.
pub struct Program {
    pub index: usize,
    pub blocks: Vec<Block>,
    pub lm: String,
    /// Whether some region computes in bf16 (the test then compares the
    /// tensor-parallel runs in f64, where regions are no-ops, and the
    /// pipeline run in f32 against one rank running the same microbatches).
    pub half: bool,
    /// The features it exercises, for the summary.
    pub features: Vec<&'static str>,
}

impl Program {
    pub fn source(&self) -> String {
        let mut s: String = self.blocks.iter().map(Block::source).collect::<Vec<_>>().join("\n");
        s.push('\n');
        s.push_str(&self.lm);
        s
    }

    pub fn lm_name(&self) -> String {
        format!("Lm{}", self.index)
    }
}

struct Gen<'r> {
    rng: &'r mut Rng,
    prefix: String,
    fields: Vec<Field>,
    vals: Vec<Val>,
    lets: Vec<String>,
    subs: Vec<Block>,
    depth: usize,
    features: Vec<&'static str>,
    half: bool,
}

impl<'r> Gen<'r> {
    fn feature(&mut self, f: &'static str) {
        if !self.features.contains(&f) {
            self.features.push(f);
        }
    }

    fn new_name(&self, stem: &str) -> String {
        format!("{stem}{}", self.fields.len())
    }

    /// A value of kind `k`, counted as used; `None` if there is none.
    fn take(&mut self, k: Kind) -> Option<String> {
        let idx: Vec<usize> = (0..self.vals.len()).filter(|&i| self.vals[i].kind == k).collect();
        if idx.is_empty() {
            return None;
        }
        // Prefer values nobody has used yet, but reuse some (residuals).
        let fresh: Vec<usize> = idx.iter().copied().filter(|&i| self.vals[i].uses == 0).collect();
        let i = if !fresh.is_empty() && self.rng.chance(0.7) { fresh[self.rng.below(fresh.len())] } else { idx[self.rng.below(idx.len())] };
        if self.vals[i].uses > 0 {
            self.feature("value reuse");
        }
        self.vals[i].uses += 1;
        Some(self.vals[i].var.clone())
    }

    fn has(&self, k: Kind) -> bool {
        self.vals.iter().any(|v| v.kind == k)
    }

    fn bind(&mut self, expr: String, kind: Kind) -> String {
        let var = format!("v{}", self.lets.len());
        self.lets.push(format!("let {var} = {expr};"));
        self.vals.push(Val { var: var.clone(), kind, uses: 0 });
        var
    }

    /// Adds a field, with random `#[recompute]` and `#[precision]`.
    fn field(&mut self, mut f: Field) -> String {
        if f.recomputable && self.rng.chance(0.15) {
            if f.selective && self.rng.chance(0.5) {
                f.attrs.push("#[recompute(selective)]".into());
                self.feature("selective recompute");
            } else {
                f.attrs.push("#[recompute]".into());
                self.feature("recompute");
            }
        }
        if self.rng.chance(0.08) {
            if self.rng.chance(0.6) {
                f.attrs.push("#[precision(bf16)]".into());
                self.half = true;
                self.feature("bf16 region");
            } else {
                f.attrs.push("#[precision(f32)]".into());
                self.feature("f32 region");
            }
        }
        // Tie to an earlier field of the same role and shape, sometimes.
        if let Some(group) = &f.tie_group {
            let partners: Vec<String> = self
                .fields
                .iter()
                .filter(|g| g.tie_group.as_ref() == Some(group) && !g.attrs.iter().any(|a| a.starts_with("#[tied")))
                .map(|g| g.name.clone())
                .collect();
            if !partners.is_empty() && self.rng.chance(0.3) {
                let p = partners[self.rng.below(partners.len())].clone();
                f.attrs.push(format!("#[tied({p})]"));
                self.feature("tied weights");
            }
        }
        let name = f.name.clone();
        self.fields.push(f);
        name
    }

    fn linear(&mut self, stem: &str, role: Role, shard: Option<&str>, d_in: usize, d_out: usize) -> String {
        let name = self.new_name(stem);
        let bias = self.rng.chance(0.6);
        let attrs = shard.map(|s| vec![format!("#[shard({s})]")]).unwrap_or_default();
        let tie_group = Some(format!("{shard:?}{d_in}x{d_out}"));
        self.field(Field {
            name,
            ty: "Linear".into(),
            ctor: format!("Linear::new({d_in}, {d_out}, {bias})?"),
            attrs,
            role,
            recomputable: true,
            selective: false,
            tie_group,
        })
    }

    /// Some field of `role` to reuse, sometimes (a layer applied twice).
    fn reuse(&mut self, role: &Role) -> Option<String> {
        let c: Vec<String> = self.fields.iter().filter(|f| f.role == *role).map(|f| f.name.clone()).collect();
        if !c.is_empty() && self.rng.chance(0.25) {
            self.feature("layer reuse");
            Some(c[self.rng.below(c.len())].clone())
        } else {
            None
        }
    }

    /// One random operation whose operands exist (drawn by weight, again
    /// until one applies).
    fn step(&mut self) {
        const OPS: [(u32, u8); 12] = [(3, 0), (2, 1), (3, 2), (4, 3), (4, 4), (1, 5), (1, 6), (2, 7), (4, 8), (4, 9), (1, 10), (2, 11)];
        let total: u32 = OPS.iter().map(|(w, _)| w).sum();
        loop {
            let mut pick = self.rng.below(total as usize) as u32;
            let op = OPS
                .iter()
                .find(|(w, _)| {
                    if pick < *w {
                        true
                    } else {
                        pick -= w;
                        false
                    }
                })
                .expect("in range")
                .1;
            let done = match op {
                0 => self.r_to_r_layer(),
                1 => self.pointwise(),
                2 => self.column(),
                3 => self.attention(),
                4 => self.row(),
                5 => self.binary("swiglu"),
                6 => self.binary("*"),
                7 => self.binary("+"),
                8 => self.reduce(),
                9 => self.gather(),
                10 => self.special(),
                _ => self.depth == 0 && self.nested(),
            };
            if done {
                return;
            }
        }
    }

    fn r_to_r_layer(&mut self) -> bool {
        let Some(a) = self.take(Kind::R) else { return false };
        let f = match self.reuse(&Role::RtoR) {
            Some(f) => f,
            None => match self.rng.below(3) {
                0 => {
                    self.feature("LayerNorm");
                    let n = self.new_name("ln");
                    let bias = self.rng.chance(0.5);
                    self.field(Field {
                        name: n,
                        ty: "LayerNorm".into(),
                        ctor: format!("LayerNorm::new({D}, 1e-5, {bias})?"),
                        attrs: vec![],
                        role: Role::RtoR,
                        recomputable: true,
                        selective: false,
                        tie_group: None,
                    })
                }
                1 => {
                    self.feature("RmsNorm");
                    let n = self.new_name("rms");
                    self.field(Field {
                        name: n,
                        ty: "RmsNorm".into(),
                        ctor: format!("RmsNorm::new({D}, 1e-6)?"),
                        attrs: vec![],
                        role: Role::RtoR,
                        recomputable: true,
                        selective: false,
                        tie_group: None,
                    })
                }
                _ => {
                    self.feature("unsharded Linear");
                    self.linear("lin", Role::RtoR, None, D, D)
                }
            },
        };
        self.bind(format!("self.{f}({a})"), Kind::R);
        true
    }

    fn pointwise(&mut self) -> bool {
        let kinds: Vec<Kind> = self.vals.iter().map(|v| v.kind).filter(|k| *k != Kind::P).collect();
        if kinds.is_empty() {
            return false;
        }
        let k = kinds[self.rng.below(kinds.len())];
        let a = self.take(k).expect("present");
        let f = if self.rng.chance(0.5) { "gelu" } else { "silu" };
        self.feature(f);
        self.bind(format!("{f}({a})"), k);
        true
    }

    fn column(&mut self) -> bool {
        let Some(a) = self.take(Kind::R) else { return false };
        let w = if self.rng.chance(0.5) { Width::Hid } else { Width::Qkv };
        let role = Role::Column(w);
        let f = match self.reuse(&role) {
            Some(f) => f,
            None => self.linear("col", role, Some("column"), D, w.size()),
        };
        self.feature("column-parallel Linear");
        self.bind(format!("self.{f}({a})"), Kind::H(w));
        true
    }

    fn attention(&mut self) -> bool {
        let Some(a) = self.take(Kind::H(Width::Qkv)) else { return false };
        let f = match self.reuse(&Role::Attention) {
            Some(f) => f,
            None => {
                let n = self.new_name("attn");
                let rope = if self.rng.chance(0.5) { ".with_rope(10_000.0, 16)?" } else { "" };
                self.field(Field {
                    name: n,
                    ty: "CausalAttention".into(),
                    ctor: format!("CausalAttention::new(4, 4, 2)?{rope}"),
                    attrs: vec![],
                    role: Role::Attention,
                    recomputable: true,
                    selective: true,
                    tie_group: None,
                })
            }
        };
        self.feature("attention");
        self.bind(format!("self.{f}({a})"), Kind::H(Width::Att));
        true
    }

    fn row(&mut self) -> bool {
        let w = match (self.has(Kind::H(Width::Hid)), self.has(Kind::H(Width::Att))) {
            (true, true) => {
                if self.rng.chance(0.5) {
                    Width::Hid
                } else {
                    Width::Att
                }
            }
            (true, false) => Width::Hid,
            (false, true) => Width::Att,
            _ => return false,
        };
        let a = self.take(Kind::H(w)).expect("present");
        let role = Role::Row(w);
        let f = match self.reuse(&role) {
            Some(f) => f,
            None => self.linear("row", role, Some("row"), w.size(), D),
        };
        self.feature("row-parallel Linear");
        self.bind(format!("self.{f}({a})"), Kind::P);
        true
    }

    fn binary(&mut self, op: &'static str) -> bool {
        let mut kinds: Vec<Kind> = self.vals.iter().map(|v| v.kind).collect();
        if op != "+" {
            kinds.retain(|k| *k != Kind::P);
        }
        if kinds.is_empty() {
            return false;
        }
        let k = kinds[self.rng.below(kinds.len())];
        let a = self.take(k).expect("present");
        let b = self.take(k).expect("present");
        self.feature(match op {
            "+" if k == Kind::P => "sum of partial sums",
            "+" => "residual +",
            "*" => "*",
            _ => "swiglu",
        });
        let e = if op == "swiglu" { format!("swiglu({a}, {b})") } else { format!("{a} {op} {b}") };
        self.bind(e, k);
        true
    }

    fn reduce(&mut self) -> bool {
        let Some(a) = self.take(Kind::P) else { return false };
        if self.rng.chance(0.7) {
            self.feature("all_reduce");
            self.bind(format!("all_reduce({a})"), Kind::R);
        } else {
            self.feature("reduce_scatter");
            self.bind(format!("reduce_scatter({a})"), Kind::S);
        }
        true
    }

    fn gather(&mut self) -> bool {
        let Some(a) = self.take(Kind::S) else { return false };
        self.feature("all_gather");
        self.bind(format!("all_gather({a})"), Kind::R);
        true
    }

    /// Dropout, a learned position table, or a mixture of experts.
    fn special(&mut self) -> bool {
        let Some(a) = self.take(Kind::R) else { return false };
        let (stem, ty, ctor, feature, recomputable) = match self.rng.below(5) {
            0 | 1 => ("drop", "Dropout", "Dropout::new(0.25)?".to_string(), "dropout", false),
            2 | 3 => ("pos", "PositionEmbedding", format!("PositionEmbedding::new(16, {D})?"), "PositionEmbedding", false),
            _ => ("moe", "Moe", format!("Moe::new({D}, {HID}, 4, 2)?"), "mixture of experts", true),
        };
        self.feature(feature);
        let existing: Vec<String> = self.fields.iter().filter(|f| f.ty == ty).map(|f| f.name.clone()).collect();
        let f = if !existing.is_empty() && self.rng.chance(0.5) {
            self.feature("layer reuse");
            existing[self.rng.below(existing.len())].clone()
        } else {
            let n = self.new_name(stem);
            self.field(Field { name: n, ty: ty.into(), ctor, attrs: vec![], role: Role::RtoR, recomputable, selective: false, tie_group: None })
        };
        self.bind(format!("self.{f}({a})"), Kind::R);
        true
    }

    /// A nested generated block, called once or stacked twice.
    fn nested(&mut self) -> bool {
        let Some(a) = self.take(Kind::R) else { return false };
        let stacked = self.rng.chance(0.4);
        let out = if !stacked && self.rng.chance(0.4) { Kind::P } else { Kind::R };
        let name = format!("{}S{}", self.prefix, self.subs.len());
        let mut g = Gen {
            rng: self.rng,
            prefix: name.clone(),
            fields: vec![],
            vals: vec![],
            lets: vec![],
            subs: vec![],
            depth: self.depth + 1,
            features: vec![],
            half: false,
        };
        let steps = 2 + g.rng.below(4);
        let sub = g.block(name.clone(), steps, out);
        let (features, half) = (std::mem::take(&mut g.features), g.half);
        for f in features {
            self.feature(f);
        }
        self.half |= half;
        self.subs.push(sub);
        let field = if stacked {
            self.feature("stack of nested blocks");
            let n = self.new_name("stack");
            self.field(Field {
                name: n,
                ty: format!("Stack<{name}>"),
                ctor: format!("Stack::from_fn(2, |_| {name}::new())?"),
                attrs: vec![],
                role: Role::RtoR,
                recomputable: true,
                selective: true,
                tie_group: None,
            })
        } else {
            self.feature("nested block");
            let n = self.new_name("sub");
            let role = if out == Kind::P { Role::RtoP } else { Role::RtoR };
            self.field(Field {
                name: n,
                ty: name.clone(),
                ctor: format!("{name}::new()?"),
                attrs: vec![],
                role,
                recomputable: true,
                selective: true,
                tie_group: None,
            })
        };
        self.bind(format!("self.{field}({a})"), out);
        true
    }

    /// `steps` random operations, then every value nobody used folded into
    /// the output (of kind `out`: `R` or `P`).
    fn block(&mut self, name: String, steps: usize, out: Kind) -> Block {
        self.vals.push(Val { var: "x".into(), kind: Kind::R, uses: 0 });
        // Start with a layer so that every block has a parameter.
        self.r_to_r_layer();
        for _ in 0..steps {
            self.step();
        }
        let output = loop {
            let dangling: Vec<(usize, Kind)> = self.vals.iter().enumerate().filter(|(_, v)| v.uses == 0).map(|(i, v)| (i, v.kind)).collect();
            if dangling.len() == 1 && dangling[0].1 == out {
                break self.vals[dangling[0].0].var.clone();
            }
            let Some(&(i, k)) = dangling.iter().find(|(_, k)| *k != out) else {
                // Only values of the output's kind are left: add two.
                let (a, b) = (dangling[0].0, dangling[1].0);
                self.vals[a].uses += 1;
                self.vals[b].uses += 1;
                let e = format!("{} + {}", self.vals[a].var, self.vals[b].var);
                self.bind(e, out);
                continue;
            };
            // Move a value of another kind one step towards the output's.
            let var = self.vals[i].var.clone();
            self.vals[i].uses += 1;
            match k {
                Kind::H(Width::Qkv) => {
                    let f = self.fields.iter().find(|f| f.role == Role::Attention).map(|f| f.name.clone());
                    let f = match f {
                        Some(f) => f,
                        None => {
                            let n = self.new_name("attn");
                            self.field(Field {
                                name: n,
                                ty: "CausalAttention".into(),
                                ctor: "CausalAttention::new(4, 4, 2)?".into(),
                                attrs: vec![],
                                role: Role::Attention,
                                recomputable: true,
                                selective: true,
                                tie_group: None,
                            })
                        }
                    };
                    self.feature("attention");
                    self.bind(format!("self.{f}({var})"), Kind::H(Width::Att));
                }
                Kind::H(w) => {
                    let f = self.linear("row", Role::Row(w), Some("row"), w.size(), D);
                    self.feature("row-parallel Linear");
                    self.bind(format!("self.{f}({var})"), Kind::P);
                }
                Kind::P => {
                    self.feature("all_reduce");
                    self.bind(format!("all_reduce({var})"), Kind::R);
                }
                Kind::S => {
                    self.feature("all_gather");
                    self.bind(format!("all_gather({var})"), Kind::R);
                }
                Kind::R => {
                    let c = self.linear("col", Role::Column(Width::Hid), Some("column"), D, HID);
                    self.bind(format!("gelu(self.{c}({var}))"), Kind::H(Width::Hid));
                }
            }
        };
        Block { name, fields: std::mem::take(&mut self.fields), lets: std::mem::take(&mut self.lets), output, out }
    }
}

/// Program `index` of the stream seeded with `seed`.
pub fn program(seed: u64, index: usize) -> Program {
    let mut rng = Rng::new(seed ^ (index as u64).wrapping_mul(0xA076_1D64_78BD_642F));
    let name = format!("Fz{index}");
    let steps = 3 + rng.below(8);
    let mut g = Gen { rng: &mut rng, prefix: name.clone(), fields: vec![], vals: vec![], lets: vec![], subs: vec![], depth: 0, features: vec![], half: false };
    let block = g.block(name.clone(), steps, Kind::R);
    let mut blocks = std::mem::take(&mut g.subs);
    let (mut features, mut half) = (std::mem::take(&mut g.features), g.half);
    drop(g);
    blocks.push(block);

    // The language model around it: embedding, the block stacked as the
    // pipeline's split field, a norm and an output head.
    let vocab_tok = rng.chance(0.7);
    let vocab_head = rng.chance(0.75);
    let tied = vocab_tok == vocab_head && rng.chance(0.5);
    let pos = rng.chance(0.3);
    let mut model_attrs = String::new();
    if rng.chance(0.15) {
        model_attrs.push_str("#[model(precision = bf16)]\n");
        half = true;
        features.push("bf16 model");
    }
    let mut split_attrs = String::new();
    match rng.below(6) {
        0 => split_attrs.push_str("#[recompute] "),
        1 => split_attrs.push_str("#[recompute(selective)] "),
        _ => {}
    }
    if rng.chance(0.12) {
        split_attrs.push_str("#[precision(bf16)] ");
        half = true;
        features.push("bf16 split field");
    }
    if tied {
        features.push("tied embedding");
    }
    let norm = if rng.chance(0.5) { ("LayerNorm", format!("LayerNorm::new({D}, 1e-5, true)?")) } else { ("RmsNorm", format!("RmsNorm::new({D}, 1e-6)?")) };
    let lm = format!("Lm{index}");
    let tok_attr = if vocab_tok { "#[shard(vocab)] " } else { "" };
    let head_attr = format!("{}{}", if vocab_head { "#[shard(vocab)] " } else { "" }, if tied { "#[tied(tok)] " } else { "" });
    let out = if vocab_head { "SplitHidden" } else { "Replicated" };
    let embed = if vocab_tok { "all_reduce(self.tok(ids))" } else { "self.tok(ids)" };
    let (pos_field, pos_ctor, pos_call) = if pos {
        (
            "    #[stage(first)] pos: PositionEmbedding,\n".to_string(),
            format!("            pos: PositionEmbedding::new(8, {D})?,\n"),
            "        let h = self.pos(h);\n",
        )
    } else {
        (String::new(), String::new(), "")
    };
    let source = format!(
        "#[derive(Module)]\n{model_attrs}pub struct {lm} {{\n    #[stage(first)] {tok_attr}tok: Embedding,\n{pos_field}    #[stage(split)] {split_attrs}blocks: Stack<{name}>,\n    #[stage(last)] norm: {norm_ty},\n    #[stage(last)] {head_attr}head: Linear,\n}}\n\n#[forward]\nimpl {lm} {{\n    fn forward(&self, ids: Act<Replicated>) -> Act<{out}> {{\n        let h = {embed};\n{pos_call}        self.head(self.norm(self.blocks(h)))\n    }}\n}}\n\nimpl {lm} {{\n    pub fn new() -> Result<{lm}> {{\n        Ok({lm} {{\n            tok: Embedding::new({VOCAB}, {D})?,\n{pos_ctor}            blocks: Stack::from_fn(2, |_| {name}::new())?,\n            norm: {norm_ctor},\n            head: Linear::new({D}, {VOCAB}, false)?,\n        }})\n    }}\n}}\n",
        norm_ty = norm.0,
        norm_ctor = norm.1,
    );
    Program { index, blocks, lm: source, half, features }
}

/// Token ids of the programs' language models.
pub const VOCAB: usize = 16;
