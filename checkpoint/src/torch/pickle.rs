//! A restricted unpickler for the `data.pkl` of PyTorch checkpoint files: it builds a graph
//! of plain values and never calls anything. Note [restricted unpickling].
//!
//! Note [restricted unpickling]: Python's pickle is a small stack machine whose GLOBAL and
//! REDUCE opcodes import and call any function named in the file (`os.system`), which is why
//! `torch.load(weights_only=False)` on a stranger's checkpoint runs the stranger's code. Here
//! REDUCE, NEWOBJ and BUILD only record "this callable with these arguments" as a node, and
//! GLOBAL refuses, by name, every global outside the handful that PyTorch's and DeepSpeed's
//! checkpoints use (`ALLOWED`), before anything else is read. The values live in an arena
//! and the memo holds indices, so a pickle that refers to one object many times (or to a
//! list inside itself) costs one node, not a copy per reference; every node comes from at
//! least one input byte, so the graph is never larger than the file. candle's `pickle::Stack`
//! was the candidate crate: it clones memoised objects on every reference (a few hundred
//! bytes can ask for gigabytes), allocates a string's declared length before reading it and
//! accepts any global, so it is not used for files from outside.

use std::collections::HashMap;

/// The globals a checkpoint may name: PyTorch's containers and tensor rebuilders, the
/// storage classes and dtypes, and DeepSpeed's few objects (its loss scalers, the ZeRO stage
/// enum, the bf16 optimizer's fragment addresses).
pub const ALLOWED: &[&str] = &[
    "collections.OrderedDict",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch._tensor._rebuild_from_type_v2",
    "torch.Size",
    "torch.Tensor",
    "torch.nn.parameter.Parameter",
    "torch.FloatStorage",
    "torch.BFloat16Storage",
    "torch.HalfStorage",
    "torch.DoubleStorage",
    "torch.LongStorage",
    "torch.IntStorage",
    "torch.ByteStorage",
    "torch.BoolStorage",
    "torch.float32",
    "torch.bfloat16",
    "torch.float16",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
];

/// A node's index in the arena.
pub type Id = usize;

/// A value of the pickle: Python's plain values, and for the allowed globals the calls and
/// object states the file asks for, recorded rather than made.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    /// A dict or an OrderedDict, in insertion order.
    Dict(Vec<(Id, Id)>),
    /// One of `ALLOWED`, as "module.name".
    Global(&'static str),
    /// REDUCE or NEWOBJ: `callable(*args)`, not called.
    Call {
        callable: Id,
        args: Id,
    },
    /// BUILD on something other than a dict: the object and the state to set on it.
    Build {
        object: Id,
        state: Id,
    },
    /// BINPERSID: PyTorch's reference to a storage record, the tuple it names.
    Persistent(Id),
}

/// A parsed pickle: its arena and the value STOP left on top.
#[derive(Debug)]
pub struct Pickle {
    pub nodes: Vec<Node>,
    pub root: Id,
}

/// A stack entry: a value, or MARK's marker.
#[derive(Clone, Copy, PartialEq)]
enum Item {
    Mark,
    Value(Id),
}

/// What went wrong, with the byte offset of the opcode.
#[derive(Debug, Clone, PartialEq)]
pub struct PickleError {
    pub at: usize,
    pub what: String,
}

impl std::fmt::Display for PickleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pickle byte {}: {}", self.at, self.what)
    }
}

type Step<T> = std::result::Result<T, String>;

/// Parses `data` (a whole pickle, STOP included).
pub fn parse(data: &[u8]) -> Result<Pickle, PickleError> {
    let mut m = Machine {
        data,
        pos: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
    };
    loop {
        let at = m.pos;
        match m.step() {
            Ok(true) => break,
            Ok(false) => {}
            Err(what) => return Err(PickleError { at, what }),
        }
    }
    let at = m.pos;
    let root = match m.stack.pop() {
        Some(Item::Value(id)) if m.stack.is_empty() => id,
        _ => {
            return Err(PickleError {
                at,
                what: "STOP without exactly one value on the stack".into(),
            })
        }
    };
    Ok(Pickle {
        nodes: m.nodes,
        root,
    })
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    nodes: Vec<Node>,
    stack: Vec<Item>,
    memo: HashMap<u64, Id>,
}

impl Machine<'_> {
    /// Runs one opcode; true at STOP.
    fn step(&mut self) -> Step<bool> {
        let op = self.bytes(1)?[0];
        match op {
            0x80 => {
                let proto = self.bytes(1)?[0];
                if proto > 5 {
                    return Err(format!("pickle protocol {proto} (at most 5)"));
                }
            }
            0x95 => {
                self.bytes(8)?; // FRAME: a length hint
            }
            b'.' => return Ok(true),
            b'(' => self.stack.push(Item::Mark),
            b'0' => {
                self.pop_item()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let top = self.top()?;
                self.stack.push(Item::Value(top));
            }
            b'N' => self.push(Node::None),
            0x88 => self.push(Node::Bool(true)),
            0x89 => self.push(Node::Bool(false)),
            b'J' => {
                let v = i32::from_le_bytes(self.array()?);
                self.push(Node::Int(v as i64))
            }
            b'K' => {
                let v = self.bytes(1)?[0];
                self.push(Node::Int(v as i64))
            }
            b'M' => {
                let v = u16::from_le_bytes(self.array()?);
                self.push(Node::Int(v as i64))
            }
            0x8a => {
                let n = self.bytes(1)?[0] as usize;
                let v = self.long(n)?;
                self.push(Node::Int(v))
            }
            0x8b => {
                let n = u32::from_le_bytes(self.array()?) as usize;
                let v = self.long(n)?;
                self.push(Node::Int(v))
            }
            b'G' => {
                let v = f64::from_be_bytes(self.array()?);
                self.push(Node::Float(v))
            }
            b'X' => {
                let n = u32::from_le_bytes(self.array()?) as usize;
                self.string(n)?
            }
            0x8c => {
                let n = self.bytes(1)?[0] as usize;
                self.string(n)?
            }
            0x8d => {
                let n = u64::from_le_bytes(self.array()?);
                self.string(usize::try_from(n).map_err(|_| "string too long".to_string())?)?
            }
            b')' => self.push(Node::Tuple(vec![])),
            b't' => {
                let items = self.pop_mark()?;
                self.push(Node::Tuple(items))
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = (0..n).map(|_| self.pop()).collect::<Step<Vec<Id>>>()?;
                items.reverse();
                self.push(Node::Tuple(items))
            }
            b']' => self.push(Node::List(vec![])),
            b'l' => {
                let items = self.pop_mark()?;
                self.push(Node::List(items))
            }
            b'a' => {
                let v = self.pop()?;
                self.append(vec![v])?
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.append(items)?
            }
            b'}' => self.push(Node::Dict(vec![])),
            b'd' => {
                let items = self.pop_mark()?;
                let pairs = pairs(items)?;
                self.push(Node::Dict(pairs))
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![(k, v)])?
            }
            b'u' => {
                let items = self.pop_mark()?;
                self.set_items(pairs(items)?)?
            }
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(&module, &name)?
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (&self.nodes[module], &self.nodes[name]) {
                    (Node::Str(m), Node::Str(n)) => {
                        let (m, n) = (m.clone(), n.clone());
                        self.global(&m, &n)?
                    }
                    _ => return Err("STACK_GLOBAL of values that are not strings".into()),
                }
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let callable = self.pop()?;
                self.call(callable, args)?
            }
            b'b' => {
                let state = self.pop()?;
                let object = self.pop()?;
                self.build(object, state)?
            }
            b'Q' => {
                let id = self.pop()?;
                self.push(Node::Persistent(id))
            }
            b'q' => {
                let k = self.bytes(1)?[0] as u64;
                self.put(k)?
            }
            b'r' => {
                let k = u32::from_le_bytes(self.array()?) as u64;
                self.put(k)?
            }
            0x94 => {
                let k = self.memo.len() as u64;
                self.put(k)?
            }
            b'h' => {
                let k = self.bytes(1)?[0] as u64;
                self.get(k)?
            }
            b'j' => {
                let k = u32::from_le_bytes(self.array()?) as u64;
                self.get(k)?
            }
            other => {
                return Err(format!(
                    "opcode {} is not one checkpoints use",
                    describe(other)
                ))
            }
        }
        Ok(false)
    }

    fn bytes(&mut self, n: usize) -> Step<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        match end {
            Some(end) => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(format!(
                "the data ends ({} bytes) inside an opcode that needs {n} more",
                self.data.len()
            )),
        }
    }

    fn array<const N: usize>(&mut self) -> Step<[u8; N]> {
        Ok(self.bytes(N)?.try_into().expect("invariant: N bytes"))
    }

    /// A little-endian two's-complement integer of `n` bytes (LONG1, LONG4).
    fn long(&mut self, n: usize) -> Step<i64> {
        if n > 8 {
            return Err(format!("an integer of {n} bytes (at most 8)"));
        }
        let b = self.bytes(n)?;
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(b);
        if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
            v[n..].fill(0xff);
        }
        Ok(i64::from_le_bytes(v))
    }

    fn string(&mut self, n: usize) -> Step<()> {
        let s = std::str::from_utf8(self.bytes(n)?)
            .map_err(|e| format!("a string that is not UTF-8 ({e})"))?
            .to_string();
        self.push(Node::Str(s));
        Ok(())
    }

    /// GLOBAL's newline-terminated name.
    fn line(&mut self) -> Step<String> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .take(256)
            .position(|&b| b == b'\n')
            .ok_or("a GLOBAL name without its newline within 256 bytes")?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }

    fn global(&mut self, module: &str, name: &str) -> Step<()> {
        let full = format!("{module}.{name}");
        match ALLOWED.iter().find(|a| **a == full) {
            Some(a) => {
                self.push(Node::Global(a));
                Ok(())
            }
            None => Err(format!(
                "global {full} is not one that PyTorch or DeepSpeed checkpoints use; refused \
                 (nothing from the file is run)"
            )),
        }
    }

    fn call(&mut self, callable: Id, args: Id) -> Step<()> {
        match self.nodes[callable] {
            // OrderedDict() is an empty dict; SETITEMS fill it next
            Node::Global("collections.OrderedDict") => self.push(Node::Dict(vec![])),
            Node::Global(_) => self.push(Node::Call { callable, args }),
            _ => return Err("a call of something that is not an allowed global".into()),
        }
        Ok(())
    }

    fn build(&mut self, object: Id, state: Id) -> Step<()> {
        let merged = match (&self.nodes[object], &self.nodes[state]) {
            (Node::Dict(_), Node::Dict(s)) => Some(s.clone()),
            _ => None,
        };
        match merged {
            Some(items) => {
                if let Node::Dict(d) = &mut self.nodes[object] {
                    d.extend(items);
                }
                self.stack.push(Item::Value(object));
            }
            None => self.push(Node::Build { object, state }),
        }
        Ok(())
    }

    fn append(&mut self, items: Vec<Id>) -> Step<()> {
        let top = self.top()?;
        match &mut self.nodes[top] {
            Node::List(l) => {
                l.extend(items);
                Ok(())
            }
            _ => Err("APPEND to something that is not a list".into()),
        }
    }

    fn set_items(&mut self, items: Vec<(Id, Id)>) -> Step<()> {
        let top = self.top()?;
        match &mut self.nodes[top] {
            Node::Dict(d) => {
                d.extend(items);
                Ok(())
            }
            _ => Err("SETITEM on something that is not a dict".into()),
        }
    }

    fn put(&mut self, k: u64) -> Step<()> {
        let top = self.top()?;
        self.memo.insert(k, top);
        Ok(())
    }

    fn get(&mut self, k: u64) -> Step<()> {
        let id = *self
            .memo
            .get(&k)
            .ok_or_else(|| format!("memo entry {k} was never stored"))?;
        self.stack.push(Item::Value(id));
        Ok(())
    }

    fn push(&mut self, n: Node) {
        self.nodes.push(n);
        self.stack.push(Item::Value(self.nodes.len() - 1));
    }

    fn pop_item(&mut self) -> Step<Item> {
        self.stack.pop().ok_or_else(|| "the stack is empty".into())
    }

    fn pop(&mut self) -> Step<Id> {
        match self.pop_item()? {
            Item::Value(id) => Ok(id),
            Item::Mark => Err("a MARK where a value was expected".into()),
        }
    }

    fn top(&self) -> Step<Id> {
        match self.stack.last() {
            Some(Item::Value(id)) => Ok(*id),
            _ => Err("no value on top of the stack".into()),
        }
    }

    /// The values above the newest MARK, which goes.
    fn pop_mark(&mut self) -> Step<Vec<Id>> {
        let mark = self
            .stack
            .iter()
            .rposition(|i| *i == Item::Mark)
            .ok_or("no MARK on the stack")?;
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        Ok(items
            .into_iter()
            .map(|i| match i {
                Item::Value(id) => id,
                Item::Mark => unreachable!("invariant: above the newest mark"),
            })
            .collect())
    }
}

fn pairs(items: Vec<Id>) -> Step<Vec<(Id, Id)>> {
    if !items.len().is_multiple_of(2) {
        return Err("an odd number of values for a dict's keys and values".into());
    }
    Ok(items.chunks(2).map(|c| (c[0], c[1])).collect())
}

/// An opcode byte as pickletools prints it: its character when printable.
fn describe(op: u8) -> String {
    match op {
        0x20..=0x7e => format!("{:?} (0x{op:02x})", op as char),
        _ => format!("0x{op:02x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(p: &Pickle, id: Id) -> &Node {
        &p.nodes[id]
    }

    /// The bytes of `pickle.dumps({"a": [1, -2, 70000], "b": 1.5, "c": "c"}, protocol=2)`
    /// (Python 3.11), with MARK/APPENDS and memo entries.
    const DICT: &[u8] = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffJp\x11\x01\x00eX\x01\x00\x00\x00bq\x03G?\xf8\x00\x00\x00\x00\x00\x00X\x01\x00\x00\x00cq\x04h\x04u.";

    #[test]
    fn python_s_own_pickle_of_plain_values_reads_back() {
        let p = parse(DICT).unwrap();
        let Node::Dict(items) = node(&p, p.root) else {
            panic!("{:?}", node(&p, p.root))
        };
        assert_eq!(items.len(), 3);
        assert_eq!(node(&p, items[0].0), &Node::Str("a".into()));
        let Node::List(l) = node(&p, items[0].1) else {
            panic!()
        };
        let ints: Vec<&Node> = l.iter().map(|&i| node(&p, i)).collect();
        assert_eq!(
            ints,
            [&Node::Int(1), &Node::Int(-2), &Node::Int(70000)],
            "BININT1, a negative BININT, a large BININT"
        );
        assert_eq!(node(&p, items[1].1), &Node::Float(1.5));
        // "c"'s value is the memoised key itself (BINGET 4)
        assert_eq!(node(&p, items[2].1), &Node::Str("c".into()));
    }

    #[test]
    fn a_global_outside_the_allowed_set_is_refused_by_name() {
        // pickle.dumps of a class whose __reduce__ returns (os.system, ("echo hi",))
        let evil = b"\x80\x02cposix\nsystem\nq\x00X\x07\x00\x00\x00echo hiq\x01\x85q\x02Rq\x03.";
        let e = parse(evil).unwrap_err();
        assert!(e.what.contains("global posix.system"), "{e}");
        assert_eq!(e.at, 2, "refused at the GLOBAL, before the call");
    }

    #[test]
    fn memo_references_share_one_node() {
        // [[]] * 2 ** 16 through the memo: one inner list, 65536 references to it
        let mut data = b"\x80\x02]q\x00]q\x01a".to_vec();
        for _ in 0..1000 {
            data.extend_from_slice(b"h\x01a");
        }
        data.push(b'.');
        let p = parse(&data).unwrap();
        assert!(p.nodes.len() <= 3, "{} nodes", p.nodes.len());
        let Node::List(l) = node(&p, p.root) else {
            panic!()
        };
        assert_eq!(l.len(), 1001);
    }

    #[test]
    fn long1_is_twos_complement() {
        // LONG1 of 2**40 and of -(2**40)
        let p = parse(b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01.").unwrap();
        assert_eq!(node(&p, p.root), &Node::Int(1 << 40));
        let p = parse(b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\xff.").unwrap();
        assert_eq!(node(&p, p.root), &Node::Int(-(1 << 40)));
        let e = parse(b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.").unwrap_err();
        assert!(e.what.contains("9 bytes"), "{e}");
    }

    #[test]
    fn truncated_and_malformed_pickles_are_errors() {
        for (data, says) in [
            (&b"\x80\x02X\xff\xff\xff\x7fab."[..], "the data ends"),
            (b"\x80\x02", "the data ends"),
            (b"\x80\x02a.", "the stack is empty"),
            (b"\x80\x02h\x05.", "memo entry 5"),
            (b"\x80\x02K\x01K\x02.", "exactly one value"),
            (b"\x80\x02K\x01K\x02a.", "not a list"),
            (b"\x80\x02\xff.", "opcode 0xff"),
            (b"\x80\x02(K\x01d.", "odd number"),
        ] {
            let e = parse(data).unwrap_err();
            assert!(e.what.contains(says), "{data:?}: {e}");
        }
    }
}
