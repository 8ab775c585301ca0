"""The chart README made from values.yaml (hack/chart_readme.py): a value per row with its
default and comment, sections listed key by key, objects documented whole, paragraphs and
Markdown-unsafe text, and a value without a comment refused."""

from __future__ import annotations

import pytest
from hack import chart_readme

VALUES = """\
# Values of a chart.

# How many. Lines of a comment
# are joined.
replicas: 1

image:
  # Where from: <registry>/name.
  repository: name
  # Always | Never.
  pullPolicy: Never

# The pod's own, passed as it is.
securityContext:
  capabilities:
    drop: [ALL]

webhook:
  # One.
  #
  # Two, with `<code>`.
  enabled: true
  # Either of these.
  certificate:
    # A Secret.
    existingSecret: ""
  # Extra flags.
  args:
    - --a
"""


def rows(values: str) -> list[str]:
    return chart_readme.render(values).split("|---|---|---|\n", 1)[1].splitlines()


def test_each_value_is_a_row_with_its_default_and_the_comment_above_it() -> None:
    assert rows(VALUES)[:3] == [
        "| `replicas` | `1` | How many. Lines of a comment are joined. |",
        '| `image.repository` | `"name"` | Where from: &lt;registry&gt;/name. |',
        '| `image.pullPolicy` | `"Never"` | Always \\| Never. |',
    ]


def test_a_commented_mapping_is_one_value_unless_its_keys_have_comments() -> None:
    assert rows(VALUES)[3:] == [
        '| `securityContext` | `{"capabilities": {"drop": ["ALL"]}}` | '
        "The pod's own, passed as it is. |",
        "| `webhook.enabled` | `true` | One.<br><br>Two, with `<code>`. |",
        "| `webhook.certificate` |  | Either of these. |",
        '| `webhook.certificate.existingSecret` | `""` | A Secret. |',
        '| `webhook.args` | `["--a"]` | Extra flags. |',
    ]


def test_the_opening_comment_introduces_the_table() -> None:
    assert "## Values\n\nValues of a chart.\n\n| Key |" in chart_readme.render(VALUES)


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ("image:\n  # Where.\n  repository: x\n  tag: ''\n", "no comment above image.tag"),
        ("# Count.\nreplicas: 1\n\nverbose: false\n", "no comment above verbose"),
        ("# A.\na: 1\n? b\n", "values.yaml:3: not a 'key: value' line"),
    ],
    ids=["nested", "after-a-blank-line", "unknown-syntax"],
)
def test_a_value_without_a_comment_is_refused(values: str, error: str) -> None:
    with pytest.raises(chart_readme.Undocumented, match=error):
        chart_readme.render(values)
