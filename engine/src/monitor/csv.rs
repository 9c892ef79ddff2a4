//! The CSV monitor, byte-compatible with DeepSpeed's `csvMonitor`: one file per tag in the
//! log directory, named after the tag with '/' and ' ' turned into '_'
//! (`Train/Samples/lr` -> `Train_Samples_lr.csv`), a `step,<last tag segment>` header the first
//! time this process writes the file, then `step,value` rows. Python's `csv.writer` defaults
//! apply: ',' separator, "\r\n" line ends, quotes only where needed, floats as `repr()`.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::error::MonitorError;
use super::pyfloat::py_float_repr;

#[derive(Debug)]
pub(crate) struct CsvWriter {
    dir: PathBuf,
    /// File stems this process has written a header to. DeepSpeed keeps the same list, so a
    /// restarted job appending to an existing file writes a second header, as it does there.
    started: HashSet<String>,
}

impl CsvWriter {
    pub(crate) fn create(dir: &Path) -> Result<CsvWriter, MonitorError> {
        fs::create_dir_all(dir).map_err(|e| MonitorError::create_dir(dir, e))?;
        Ok(CsvWriter {
            dir: dir.to_path_buf(),
            started: HashSet::new(),
        })
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends one row (and the header on first use), opening and closing the file each time
    /// as DeepSpeed does, so every row is on disk once this returns.
    pub(crate) fn write_event(
        &mut self,
        tag: &str,
        value: f64,
        step: u64,
    ) -> Result<(), MonitorError> {
        let stem = file_stem(tag);
        let path = self.dir.join(format!("{stem}.csv"));
        let first = !self.started.contains(&stem);
        let mut text = String::new();
        if first {
            text.push_str(&row("step", header(tag)));
        }
        text.push_str(&row(&step.to_string(), &py_float_repr(value)));
        append(&path, &text)?;
        if first {
            self.started.insert(stem);
        }
        Ok(())
    }
}

fn append(path: &Path, text: &str) -> Result<(), MonitorError> {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| MonitorError::open(path, e))?;
    file.write_all(text.as_bytes())
        .map_err(|e| MonitorError::write(path, e))
}

/// DeepSpeed's column name: the tag's last '/'-separated segment.
fn header(tag: &str) -> &str {
    tag.rsplit_once('/').map_or(tag, |(_, last)| last)
}

/// DeepSpeed's file stem: `tag.replace('/', '_').replace(' ', '_')`.
fn file_stem(tag: &str) -> String {
    tag.replace(['/', ' '], "_")
}

/// A two-field row as Python's `csv.writer` writes it.
fn row(first: &str, second: &str) -> String {
    format!("{},{}\r\n", field(first), field(second))
}

/// `csv.QUOTE_MINIMAL`: quote a field holding the separator, a quote or a line break, and
/// double the quotes inside.
fn field(text: &str) -> Cow<'_, str> {
    if text.contains([',', '"', '\r', '\n']) {
        Cow::Owned(format!("\"{}\"", text.replace('"', "\"\"")))
    } else {
        Cow::Borrowed(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_deepspeed() {
        assert_eq!(
            file_stem("Train/Samples/train_loss"),
            "Train_Samples_train_loss"
        );
        assert_eq!(file_stem("my metric/a b"), "my_metric_a_b");
        assert_eq!(header("Train/Samples/train_loss"), "train_loss");
        assert_eq!(header("plain"), "plain");
        assert_eq!(header("ends/"), "");
    }

    #[test]
    fn rows_follow_python_csv() {
        // Python 3.11: csv.writer(io.StringIO()).writerow(...) for the same fields.
        assert_eq!(row("step", "lr"), "step,lr\r\n");
        assert_eq!(row("step", "a,b"), "step,\"a,b\"\r\n");
        assert_eq!(row("step", "q\""), "step,\"q\"\"\"\r\n");
        assert_eq!(row("step", " s"), "step, s\r\n");
        assert_eq!(row("step", ""), "step,\r\n");
    }
}
