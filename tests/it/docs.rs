//! The code blocks of the README, BENCHMARKS.md and `docs/`: every shell, SQL and Python
//! block is either run by a test, because it sits in a section that
//! [`RUN_SECTIONS`](crate::readme::RUN_SECTIONS) names (the `readme` tests run those), or
//! marked as illustrative by its info string (```` ```sh illustrative ````). A reader can
//! then trust that a block without the mark works as written.
//!
//! The Markdown parser here also hands the `readme` tests the blocks of their sections.

use std::path::{Path, PathBuf};

use crate::readme::RUN_SECTIONS;

/// Languages of blocks a reader would run as written.
const RUNNABLE_LANGUAGES: [&str; 6] = ["sh", "bash", "shell", "console", "sql", "python"];

/// The word of an info string that marks a block as one no test runs.
const ILLUSTRATIVE: &str = "illustrative";

/// A fenced code block of a Markdown file.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// The line of its opening fence, counted from 1.
    pub line: usize,
    /// The first word of its info string, in lowercase: what GitHub highlights it as.
    pub language: String,
    /// Whether a later word of its info string is [`ILLUSTRATIVE`].
    pub illustrative: bool,
    /// Its lines, without the indentation of the fence, each ending in a line break.
    pub text: String,
}

/// A heading of a Markdown file.
#[derive(Debug, Clone, PartialEq)]
struct Heading {
    /// The line it is on, counted from 1.
    line: usize,
    /// 1 for `#`, 2 for `##`, …
    level: usize,
    /// The whole line, trimmed: `## Quick start`.
    text: String,
}

/// The headings and code blocks of a Markdown text, in order.
#[derive(Debug, Default)]
struct Document {
    headings: Vec<Heading>,
    blocks: Vec<Block>,
}

/// A fence that opens a code block: its character, length and indentation.
struct Fence {
    character: char,
    length: usize,
    indent: usize,
}

/// The fence `line` opens or closes, with the rest of the line (the info string).
fn fence(line: &str) -> Option<(Fence, &str)> {
    let trimmed = line.trim_start();
    let indent = line.len() - trimmed.len();
    let character = trimmed.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let length = trimmed.chars().take_while(|c| *c == character).count();
    (length >= 3).then(|| {
        let fence = Fence {
            character,
            length,
            indent,
        };
        (fence, trimmed[length..].trim())
    })
}

/// Parses `text`: headings outside code blocks, and fenced code blocks. Fails, naming
/// `file` and the line, on a block that never closes.
fn parse(file: &str, text: &str) -> Document {
    let mut document = Document::default();
    let mut open: Option<(Fence, Block)> = None;
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        match open.take() {
            Some((opening, mut block)) => {
                let closes = fence(line).is_some_and(|(closing, info)| {
                    closing.character == opening.character
                        && closing.length >= opening.length
                        && info.is_empty()
                });
                if closes {
                    document.blocks.push(block);
                } else {
                    let unindented = line
                        .get(opening.indent..)
                        .filter(|_| line[..opening.indent].trim().is_empty())
                        .unwrap_or_else(|| line.trim_start());
                    block.text.push_str(unindented);
                    block.text.push('\n');
                    open = Some((opening, block));
                }
            }
            None => {
                if let Some((opening, info)) = fence(line) {
                    let mut words = info.split_whitespace();
                    let language = words.next().unwrap_or_default().to_lowercase();
                    let illustrative = words.any(|word| word == ILLUSTRATIVE);
                    let block = Block {
                        line: number,
                        language,
                        illustrative,
                        text: String::new(),
                    };
                    open = Some((opening, block));
                } else if line.starts_with('#') {
                    let level = line.chars().take_while(|c| *c == '#').count();
                    if level <= 6 && line[level..].starts_with(' ') {
                        document.headings.push(Heading {
                            line: number,
                            level,
                            text: line.trim().to_owned(),
                        });
                    }
                }
            }
        }
    }
    if let Some((_, block)) = open {
        panic!("{file}:{}: a code block that never closes", block.line);
    }
    document
}

/// The lines `heading` spans in `document`: from its own line to the line before the
/// next heading of its level or above (or the end). None when it is not a heading there;
/// fails when it is one twice.
fn section_lines(document: &Document, file: &str, heading: &str) -> Option<(usize, usize)> {
    let mut found = document
        .headings
        .iter()
        .enumerate()
        .filter(|(_, candidate)| candidate.text == heading);
    let (index, start) = found.next()?;
    assert!(
        found.next().is_none(),
        "{file}: the heading {heading:?} is there twice"
    );
    let end = document.headings[index + 1..]
        .iter()
        .find(|next| next.level <= start.level)
        .map_or(usize::MAX, |next| next.line - 1);
    Some((start.line, end))
}

/// The repository's root.
pub fn repository() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The text of `file`, relative to the repository.
fn read(file: &str) -> String {
    std::fs::read_to_string(repository().join(file))
        .unwrap_or_else(|error| panic!("read {file}: {error}"))
}

/// The code blocks of the section under `heading` (the whole heading line, `## Quick
/// start`) of `file` (relative to the repository), in order, illustrative ones included.
/// Fails when the file or the heading is not there.
pub fn section_blocks(file: &str, heading: &str) -> Vec<Block> {
    let document = parse(file, &read(file));
    let (start, end) = section_lines(&document, file, heading)
        .unwrap_or_else(|| panic!("{file} has no heading {heading:?}"));
    document
        .blocks
        .into_iter()
        .filter(|block| (start..=end).contains(&block.line))
        .collect()
}

/// The Markdown files whose blocks must be run or marked: the README, BENCHMARKS.md and
/// every `.md` under `docs/`, relative to the repository.
fn documentation_files() -> Vec<String> {
    fn markdown_under(directory: &Path, found: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(directory)
            .unwrap_or_else(|error| panic!("read {}: {error}", directory.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                markdown_under(&path, found);
            } else if path.extension().is_some_and(|extension| extension == "md") {
                found.push(path);
            }
        }
    }
    let root = repository();
    let mut found = Vec::new();
    markdown_under(&root.join("docs"), &mut found);
    let mut files: Vec<String> = found
        .iter()
        .map(|path| {
            let relative = path.strip_prefix(&root).expect("under the repository");
            relative.to_string_lossy().replace('\\', "/")
        })
        .collect();
    files.sort();
    files.splice(0..0, ["README.md".to_owned(), "BENCHMARKS.md".to_owned()]);
    files
}

/// What is wrong with the blocks of `file`, whose text is `text`, given the sections
/// tests run (`sections`, of every file): one line per runnable block that is neither in
/// such a section of this file nor marked illustrative, as `file:line: ...`.
fn unrun_blocks(file: &str, text: &str, sections: &[(&str, &str)]) -> Vec<String> {
    let document = parse(file, text);
    let run: Vec<(usize, usize)> = sections
        .iter()
        .filter(|(section_file, _)| *section_file == file)
        .filter_map(|(_, heading)| section_lines(&document, file, heading))
        .collect();
    document
        .blocks
        .iter()
        .filter(|block| RUNNABLE_LANGUAGES.contains(&block.language.as_str()))
        .filter(|block| !block.illustrative)
        .filter(|block| {
            !run.iter()
                .any(|&(start, end)| (start..=end).contains(&block.line))
        })
        .map(|block| {
            format!(
                "{file}:{}: a `{}` block that no test runs: put it in a section of \
                 readme::RUN_SECTIONS (and run it there), or mark it ```{} {ILLUSTRATIVE}",
                block.line, block.language, block.language
            )
        })
        .collect()
}

#[test]
fn every_shell_sql_and_python_block_is_run_by_a_test_or_marked_illustrative() {
    let mut problems = Vec::new();
    for file in documentation_files() {
        problems.extend(unrun_blocks(&file, &read(&file), RUN_SECTIONS));
    }
    assert!(
        problems.is_empty(),
        "{} block(s) neither run nor marked:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn every_section_the_tests_run_is_there_and_has_blocks_to_run() {
    let files = documentation_files();
    for &(file, heading) in RUN_SECTIONS {
        assert!(
            files.iter().any(|checked| checked == file),
            "{file} (readme::RUN_SECTIONS) is not a file whose blocks are checked"
        );
        let blocks = section_blocks(file, heading);
        assert!(
            blocks.iter().any(|block| !block.illustrative),
            "{file}: the section {heading:?} (readme::RUN_SECTIONS) has no block to run"
        );
    }
    let mut unique = RUN_SECTIONS.to_vec();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), RUN_SECTIONS.len(), "a section listed twice");

    // And a test reads each of them: the list names its sections by constants, and each
    // constant is handed to `blocks_to_run` by a test.
    let runners = include_str!("readme.rs");
    let list = runners
        .split_once("pub const RUN_SECTIONS: &[Section] = &[")
        .and_then(|(_, rest)| rest.split_once("];"))
        .map(|(list, _)| list)
        .expect("readme.rs lists RUN_SECTIONS by name");
    let names: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .collect();
    assert_eq!(names.len(), RUN_SECTIONS.len(), "{names:?}");
    for name in names {
        assert!(
            runners.contains(&format!("blocks_to_run({name})")),
            "no test in readme.rs runs the blocks of {name}, which RUN_SECTIONS lists"
        );
    }
}

#[test]
fn the_check_names_each_unmarked_block_outside_the_sections_run() {
    let text = "\
# Title

## Run

```sh
echo run by a test
```

### Below it, still in it

```python
print('run too')
```

## Not run

```sh illustrative
echo marked
```

```toml
# gateway.toml: not a language that runs
```

  ```bash
  echo indented, in a list item
  ```

````sql
SELECT 1;
```
still inside
````

# Another top level

```console
$ echo outside
```
";
    let sections = [("a.md", "## Run"), ("b.md", "# Another top level")];
    assert_eq!(
        unrun_blocks("a.md", text, &sections)
            .iter()
            .map(|problem| problem.split(": ").next().unwrap())
            .collect::<Vec<_>>(),
        ["a.md:25", "a.md:29", "a.md:37"],
    );
    let document = parse("a.md", text);
    let sql = document
        .blocks
        .iter()
        .find(|block| block.language == "sql")
        .unwrap();
    assert_eq!(sql.text, "SELECT 1;\n```\nstill inside\n");
    let bash = &document.blocks[4];
    assert_eq!(
        (bash.language.as_str(), bash.text.as_str()),
        ("bash", "echo indented, in a list item\n")
    );
    assert_eq!(
        document
            .headings
            .iter()
            .map(|heading| heading.text.as_str())
            .collect::<Vec<_>>(),
        [
            "# Title",
            "## Run",
            "### Below it, still in it",
            "## Not run",
            "# Another top level"
        ],
        "a `#` line inside a block is no heading"
    );
}
