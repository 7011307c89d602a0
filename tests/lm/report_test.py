"""Unit tests of bench/lm/report.py's side-by-side tables (kvkeep's answers
beside kvpress's rows): which tasks and methods they compare, and what the
cells say. Standard library only."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "bench", "lm"))
import report  # noqa: E402


def ours(task_id, variant, budget, exact, length=1024):
    """A kvkeep answer line as answer_rows() leaves it."""
    return {"id": task_id, "task": "passkey", "length": length,
            "variant": variant, "budget": budget, "exact": exact,
            "answer_logprob": -1.0, "resident_kv_bytes": 2**20}


def theirs(task_id, press, budget, exact, length=1024):
    """A kvpress row as press_rows() leaves it."""
    return {"id": task_id, "task": "passkey", "length": length,
            "side": "kvpress", "method": press, "budget": budget,
            "exact": exact, "answer_logprob": -1.0,
            "resident_kv_bytes": 3 * 2**20}


class BudgetVersusRowsTest(unittest.TestCase):
    def setUp(self):
        self.answers = []
        self.press = []
        # t1 and t2 ran at every budget on both sides; t3 only at 25% on
        # kvpress's side (the main grid's extra keys).
        for t in ("t1", "t2", "t3"):
            self.answers.append(ours(t, "full", "all", 1))
            self.press.append(theirs(t, "full", "all", 1))
            for b in ("10%", "25%", "50%"):
                self.answers.append(ours(t, "tova", b, int(b == "50%")))
            self.press.append(theirs(t, "knorm", "25%", 1))
        for t in ("t1", "t2"):
            for b in ("10%", "25%", "50%"):
                self.press.append(theirs(t, "tova", b, 1))
        self.press.append(theirs("t3", "tova", "25%", 1))

    def test_keeps_the_tasks_every_side_and_budget_ran(self):
        rows = report.budget_versus_rows(self.answers, self.press)
        self.assertEqual({r["id"] for r in rows}, {"t1", "t2"})

    def test_keeps_the_methods_swept_and_the_full_caches(self):
        rows = report.budget_versus_rows(self.answers, self.press)
        self.assertEqual(
            sorted({(r["side"], r["method"]) for r in rows}),
            [("kvkeep", "full"), ("kvkeep", "tova"), ("kvpress", "full"),
             ("kvpress", "tova")])

    def test_one_budget_is_no_sweep(self):
        answers = [r for r in self.answers if r["budget"] in ("25%", "all")]
        press = [r for r in self.press if r["budget"] in ("25%", "all")]
        self.assertEqual(report.budget_versus_rows(answers, press), [])

    def test_the_table_has_a_column_per_budget_and_full_last(self):
        rows = report.budget_versus_rows(self.answers, self.press)
        budgets = report.by_share({r["budget"] for r in rows})
        self.assertEqual(budgets, ["10%", "25%", "50%", "all"])
        md = report.versus_md(rows, "### t", "budget", budgets,
                              lambda b: b, total=False).splitlines()
        self.assertEqual(md[2], "| side | method | 10% | 25% | 50% | all |")
        self.assertIn("| kvkeep | tova | 0.00 (1.0) | 0.00 (1.0) | "
                      "1.00 (1.0) | – |", md)
        self.assertIn("| kvpress | full | – | – | – | 1.00 (3.0) |", md)


class VersusRowsTest(unittest.TestCase):
    def test_one_budget_on_the_tasks_both_sides_answered(self):
        answers = [ours("a", "tova", "25%", 1, 1024),
                   ours("b", "tova", "25%", 0, 2048),
                   ours("a", "tova", "50%", 1, 1024)]
        press = [theirs("a", "tova", "25%", 1, 1024),
                 theirs("c", "tova", "25%", 1, 4096)]
        rows = report.versus_rows(answers, press, "25%")
        self.assertEqual(sorted((r["side"], r["id"]) for r in rows),
                         [("kvkeep", "a"), ("kvpress", "a")])
        md = report.versus_md(rows, "### t", "length", [1024],
                              lambda l: f"{l} tokens")
        self.assertIn("| kvkeep | tova | 1.00 (1.0) | 1.00 (1.0) |",
                      md.splitlines())


if __name__ == "__main__":
    unittest.main()
