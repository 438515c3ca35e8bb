//! Asking the daemon from outside its task: a message carrying its reply channel,
//! answered once its effect is durable (D1). The API's handlers and a runtime's start
//! both ask this way.

use tokio::sync::{mpsc, oneshot};

use super::{Error, Msg, Reply, RunInfo, Tenant};

/// Sends the message `make` builds around a reply channel, and waits for the answer.
pub async fn ask<T>(
    inbox: &mpsc::Sender<Msg>,
    make: impl FnOnce(Reply<T>) -> Msg,
) -> Result<T, Error> {
    let (tx, rx) = oneshot::channel();
    inbox
        .send(make(tx))
        .await
        .map_err(|_| Error::ShuttingDown)?;
    rx.await.map_err(|_| Error::ShuttingDown)?
}

/// P1/S3 with the rule checked off the state task (issue 32 finding 7: it reads
/// `/proc`, and a registration once stalled every request for 0.4 s): the daemon
/// gives the plan (other runs' roots), a blocking thread applies the rule, and the
/// daemon records the answer if no registration came between (else checks again).
pub async fn register_off_task(
    inbox: &mpsc::Sender<Msg>,
    me: Option<crate::register::Me>,
    run_id: String,
    (fence, pid): (u64, i32),
    (uid, by): (u32, Tenant),
) -> Result<RunInfo, Error> {
    let checked = match me {
        Some(me) => {
            let plan = ask(inbox, |reply| Msg::RegistrationPlan {
                run_id: run_id.clone(),
                fence,
                by,
                reply,
            })
            .await?;
            let generation = plan.generation;
            let id = tokio::task::spawn_blocking(move || {
                let others: Vec<crate::register::OtherRun<'_>> = plan
                    .others
                    .iter()
                    .map(|(id, roots)| crate::register::OtherRun {
                        run_id: id,
                        roots: roots.clone(),
                    })
                    .collect();
                crate::register::check(&me, uid, pid, &others)
            })
            .await
            .map_err(|_| Error::Internal("the registration check panicked".into()))?
            .map_err(|refusal| Error::Registration { pid, refusal })?;
            Some((id, generation))
        }
        None => None,
    };
    ask(inbox, |reply| Msg::RegisterProcess {
        run_id,
        fence,
        pid,
        uid,
        by,
        checked,
        reply,
    })
    .await
}
