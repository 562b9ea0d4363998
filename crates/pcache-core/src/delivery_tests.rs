//! Unit tests of the delivered spans (`delivery.rs`), kept beside it so that file holds the tracker only.

use super::*;

#[test]
fn positions_that_would_pass_the_largest_are_refused_changing_nothing() {
    let mut d = Deliveries::new(4).unwrap();
    d.take_step([("a", 0, 5)]).unwrap();
    let err = d
        .take_step([("b", 0, 1), ("a", 5, usize::MAX)])
        .unwrap_err();
    assert!(err
        .to_string()
        .contains("\"a\": 18446744073709551615 rows from position 5"));
    let (rows, _) = d.take_step([("a", 0, 3)]).unwrap();
    assert_eq!(
        (rows[0].count, rows[0].drop),
        (3, 0),
        "a continues at 5: nothing dropped"
    );
    let (rows, _) = d.take_step([("b", 0, 2)]).unwrap();
    assert_eq!(rows[0].drop, 0, "b was not registered by the refused call");
}

#[test]
fn rows_the_engine_dropped_are_returned_again_when_recomputed() {
    let mut d = Deliveries::new(4).unwrap();
    d.take_step([("a", 0, 6)]).unwrap(); // the prompt, delivered
    d.take_step([("a", 0, 1)]).unwrap(); // position 6, saved; its output is then dropped
    assert!(d.undeliver_from("a", 6));
    assert!(
        !d.schedule("a", &[0, 1, 2], 6).unwrap(),
        "nothing to read: 6 were delivered"
    );
    let (rows, reads) = d.take_step([("a", 0, 3)]).unwrap();
    assert!(reads.is_empty());
    assert_eq!(rows[0].drop, 0, "position 6 is returned again");
    // Undelivered below the resume point: those rows come from the pool.
    assert!(d.undeliver_from("a", 4));
    assert!(d.schedule("a", &[0, 1, 2], 9).unwrap());
    let (rows, reads) = d.take_step([("a", 0, 1)]).unwrap();
    assert_eq!(reads, vec![(0, vec![4, 5, 6, 7, 8])]);
    assert_eq!(rows[0].drop, 0);
    assert!(!d.undeliver_from("b", 0), "not live: nothing to do");
    assert!(
        d.undeliver_from("a", 100),
        "past what was delivered: no change"
    );
    let (rows, _) = d.take_step([("a", 0, 1)]).unwrap();
    assert_eq!((rows[0].count, rows[0].drop), (1, 0));
}

#[test]
fn dropped_saves_are_delivered_again_and_only_what_they_returned() {
    let mut d = Deliveries::new(4).unwrap();
    assert!(!d.undeliver_saves("a", 1).unwrap(), "not live");
    d.schedule("a", &[0, 1, 2, 3], 0).unwrap();
    assert!(
        !d.undeliver_saves("a", 1).unwrap(),
        "live, never saved: nothing to do"
    );
    d.take_step([("a", 0, 6)]).unwrap(); // delivered [0, 6)
    d.take_step([("a", 0, 1)]).unwrap(); // position 6, its output then dropped
    assert!(d.undeliver_saves("a", 1).unwrap());
    d.schedule("a", &[4, 5], 0).unwrap(); // resumed from 0, recomputing [0, 7)
    let (rows, _) = d.take_step([("a", 0, 7)]).unwrap();
    assert_eq!(
        rows[0].drop, 6,
        "position 6 is returned again, 0..6 are not"
    );
    // A save that recomputes delivered rows and adds one: dropping it loses only that one.
    d.schedule("a", &[4, 5, 6], 4).unwrap();
    d.take_step([("a", 0, 4)]).unwrap(); // [4, 8): only 7 was new
    assert!(d.undeliver_saves("a", 1).unwrap());
    d.schedule("a", &[4, 5, 6], 4).unwrap();
    let (rows, _) = d.take_step([("a", 0, 4)]).unwrap();
    assert_eq!(rows[0].drop, 3, "7 again, 4..7 not");
    // Two saves dropped (two steps in flight): both come again.
    d.take_step([("a", 0, 1)]).unwrap(); // 8
    d.take_step([("a", 0, 1)]).unwrap(); // 9
    assert!(d.undeliver_saves("a", 2).unwrap());
    d.schedule("a", &[4, 5, 6], 8).unwrap();
    let (rows, _) = d.take_step([("a", 0, 2)]).unwrap();
    assert_eq!(rows[0].drop, 0, "8 and 9 again");
    // A dropped save that carried a pool read: the read rows come again too.
    d.finish("a");
    d.schedule("a", &[7, 8], 8).unwrap(); // a hit of 8
    let (_, reads) = d.take_step([("a", 0, 1)]).unwrap();
    assert_eq!(reads.len(), 1);
    assert!(d.undeliver_saves("a", 1).unwrap());
    assert!(d.schedule("a", &[7, 8, 9], 4).unwrap(), "[0, 4) read again");
    let (rows, reads) = d.take_step([("a", 0, 5)]).unwrap();
    assert_eq!((reads, rows[0].drop), (vec![(0, vec![28, 29, 30, 31])], 0));
}

#[test]
fn more_dropped_saves_than_a_request_had_or_kept_are_refused_changing_nothing() {
    let mut d = Deliveries::new(4).unwrap();
    d.take_step([("a", 0, 2)]).unwrap();
    d.take_step([("a", 0, 1)]).unwrap();
    for (count, why) in [
        (0, "a count is 1 or more".to_string()),
        (3, "it has 2".to_string()),
        (
            MAX_DROPPED_SAVES + 1,
            format!("at most {MAX_DROPPED_SAVES}"),
        ),
    ] {
        let err = d.undeliver_saves("a", count).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("{count} dropped saves; {why}")),
            "{err}"
        );
    }
    let (rows, _) = d.take_step([("a", 0, 1)]).unwrap();
    assert_eq!(rows[0].drop, 0, "nothing was rewound: position 3 is new");
    for _ in 0..2 * MAX_DROPPED_SAVES {
        d.take_step([("a", 0, 1)]).unwrap();
    }
    assert!(
        d.undeliver_saves("a", MAX_DROPPED_SAVES).unwrap(),
        "the latest are kept"
    );
    d.schedule("a", &[0; 16], 4 + 2 * MAX_DROPPED_SAVES - MAX_DROPPED_SAVES)
        .unwrap();
    let (rows, _) = d.take_step([("a", 0, 1)]).unwrap();
    assert_eq!(rows[0].drop, 0);
}

#[test]
fn a_block_size_of_zero_is_refused() {
    assert!(matches!(
        Deliveries::new(0),
        Err(Error::InvalidConfig { .. })
    ));
}

#[test]
fn a_fresh_hit_reads_its_prefix_once_then_gets_each_steps_rows() {
    let mut d = Deliveries::new(4).unwrap();
    assert!(d.schedule("a", &[7, 2, 5], 8).unwrap());
    let planned = d.pending_read("a").map(<[i64]>::to_vec);
    assert_eq!(planned, Some(vec![28, 29, 30, 31, 8, 9, 10, 11]));
    assert_eq!(d.pending_read("b"), None, "not live");
    let (rows, reads) = d.take_step([("a", 0, 3)]).unwrap();
    assert_eq!(d.pending_read("a"), None, "taken by the save");
    assert_eq!(reads, vec![(0, vec![28, 29, 30, 31, 8, 9, 10, 11])]);
    assert_eq!(
        rows,
        vec![StepRows {
            first_row: 0,
            count: 3,
            drop: 0
        }]
    );
    let (rows, reads) = d.take_step([("b", 0, 2), ("a", 2, 1)]).unwrap();
    assert!(reads.is_empty(), "the hit span is read once");
    assert_eq!(
        rows[1],
        StepRows {
            first_row: 2,
            count: 1,
            drop: 0
        }
    );
    assert!(d.is_live("b"), "a request saved unscheduled becomes live");
}

#[test]
fn a_resumed_request_gets_neither_a_row_twice_nor_a_gap() {
    let mut d = Deliveries::new(4).unwrap();
    d.schedule("a", &[0, 1, 2], 0).unwrap();
    d.take_step([("a", 0, 10)]).unwrap(); // delivered [0, 10)
                                          // Preempted, resumed from position 4: rows 4..10 are recomputed but not returned again.
    assert!(
        !d.schedule("a", &[3, 4, 5], 4).unwrap(),
        "nothing undelivered below 4"
    );
    let (rows, _) = d.take_step([("a", 0, 8)]).unwrap();
    assert_eq!(
        rows,
        vec![StepRows {
            first_row: 0,
            count: 8,
            drop: 6
        }]
    );
    // Resumed past what it was given (12 computed, 12 delivered by now): nothing to read;
    // resumed at 16 of 12 delivered: positions 12..16 come from the pool.
    assert!(d.schedule("a", &[3, 4, 5, 6], 16).unwrap());
    let (rows, reads) = d.take_step([("a", 0, 1)]).unwrap();
    assert_eq!(reads, vec![(0, vec![24, 25, 26, 27])]);
    assert_eq!(rows[0].drop, 0);
}

#[test]
fn a_span_past_the_table_is_refused_and_changes_nothing() {
    let mut d = Deliveries::new(4).unwrap();
    assert!(d.schedule("a", &[0], 5).is_err());
    assert!(!d.is_live("a"));
    assert!(!d.finish("a") && d.is_empty());
}

#[test]
fn a_request_resumed_exactly_at_its_delivered_span_reads_nothing() {
    let mut d = Deliveries::new(4).unwrap();
    assert!(!d.schedule("a", &[0, 1], 0).unwrap(), "nothing computed");
    d.take_step([("a", 0, 6)]).unwrap(); // delivered [0, 6)
    assert!(!d.schedule("a", &[3, 4], 6).unwrap(), "6 of 6 delivered");
    let (rows, reads) = d.take_step([("a", 0, 1)]).unwrap();
    assert!(reads.is_empty(), "{reads:?}");
    assert_eq!(rows[0].drop, 0);
}

#[test]
fn a_finished_request_is_forgotten_and_comes_back_fresh() {
    let mut d = Deliveries::new(4).unwrap();
    assert_eq!(d.block_size(), 4);
    d.schedule("a", &[0, 1], 0).unwrap();
    d.take_step([("a", 0, 6), ("b", 6, 1)]).unwrap(); // a: delivered [0, 6)
    assert_eq!((d.len(), d.is_empty()), (2, false));
    assert!(d.finish("a"));
    assert!(!d.is_live("a") && d.len() == 1);
    assert!(!d.finish("a"), "already forgotten");
    // The same id again is a new request: its whole computed span comes from the pool.
    assert!(d.schedule("a", &[5, 6], 6).unwrap());
    let (rows, reads) = d.take_step([("a", 0, 2)]).unwrap();
    assert_eq!(reads, vec![(0, vec![20, 21, 22, 23, 24, 25])]);
    assert_eq!(rows[0].drop, 0);
}
