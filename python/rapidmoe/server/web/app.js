// RapidMoE chat page: conversations in localStorage, streaming /v1/chat/completions (SSE over fetch), stop, edit,
// regenerate and delete, answers rendered as markdown (markdown.js), sampling settings, live tokens/s, and for a
// RESplit model the split-routing statistics of /rapidmoe/stats. A failed turn is shown with its error but never
// sent to the model again: the request history holds only user and assistant messages of turns that succeeded, in
// turns that alternate (an answer without content is sent empty), as templates like Mistral's and Gemma's require.
"use strict";

const $ = (id) => document.getElementById(id);
// [field id = request key, label]; an empty field is left out of the request (the server's default applies)
const NUMBERS = [["temperature", "Temperature"], ["top_p", "Top-p"], ["top_k", "Top-k"], ["max_tokens", "Max tokens"],
                 ["seed", "Seed"]];
const SETTINGS = [...NUMBERS.map(([id]) => id), "system", "api_key"];
let state = load();
let controller = null;  // the AbortController of the answer being generated
let streaming = null;   // {answer, node} while an answer streams in
let editing = null;     // {chat, index, draft, fresh} of the message being edited (fresh: focus it once)

/** The stored conversations; an "error" message of an older page becomes the error of the answer it ended. */
function load() {
  const s = JSON.parse(localStorage.getItem("rapidmoe.chats") || "null") || { chats: [], current: null };
  for (const chat of s.chats) {
    const out = [];
    for (const m of chat.messages) {
      if (m.role !== "error") out.push(m);
      else if (out.length && out[out.length - 1].role === "assistant") out[out.length - 1].error = m.content;
      else out.push({ role: "assistant", content: "", error: m.content });
    }
    chat.messages = out;
  }
  return s;
}

function save() { localStorage.setItem("rapidmoe.chats", JSON.stringify(state)); }
function current() { return state.chats.find((c) => c.id === state.current); }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

/** What the model is sent: user and assistant messages, without failed turns (the answer that failed and the user
 * message right before it), starting with a user message and alternating, as chat templates that enforce it
 * (Mistral's, Gemma's) require: an answer without content (reasoning only, or stopped before its first token) is
 * sent as an empty assistant message, and an empty message of the other role stands where one was deleted. */
function history(messages) {
  const out = [];
  messages.forEach((m, i) => {
    if (m.role !== "user" && m.role !== "assistant") return;
    if (m.error) {
      if (i > 0 && messages[i - 1].role === "user" && out.length && out[out.length - 1].from === i - 1) out.pop();
      return;
    }
    const turn = out.length % 2 ? "assistant" : "user";
    if (m.role !== turn) out.push({ from: -1, role: turn, content: "" });
    out.push({ from: i, role: m.role, content: m.content || "" });
  });
  const system = $("system").value.trim();
  const msgs = out.map(({ role, content }) => ({ role, content }));
  return system ? [{ role: "system", content: system }, ...msgs] : msgs;
}

/** The sampling fields that are filled in, as numbers; throws for a field the browser cannot read as a number. */
function sampling() {
  const out = {};
  for (const [id, label] of NUMBERS) {
    const input = $(id);
    if (input.validity.badInput) throw new Error(label + " is not a number");
    const v = input.value.trim();
    if (v !== "") out[id] = Number(v);
  }
  return out;
}

function newChat() {
  const chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New conversation",
                 messages: [] };
  state.chats.unshift(chat);
  state.current = chat.id;
  editing = null;
  save();
  render();
}

function renderList() {
  const ul = $("conversations");
  ul.textContent = "";
  for (const chat of state.chats) {
    const li = document.createElement("li");
    li.className = chat.id === state.current ? "active" : "";
    const span = document.createElement("span");
    span.textContent = chat.title;
    li.appendChild(span);
    const del = document.createElement("button");
    del.textContent = "x";
    del.title = "Delete conversation";
    del.onclick = (e) => {
      e.stopPropagation();
      state.chats = state.chats.filter((c) => c.id !== chat.id);
      if (state.current === chat.id) state.current = state.chats.length ? state.chats[0].id : null;
      save();
      render();
    };
    li.appendChild(del);
    li.onclick = () => { state.current = chat.id; editing = null; save(); render(); };
    ul.appendChild(li);
  }
}

function button(action, text, title, onclick) {
  const b = document.createElement("button");
  b.type = "button";
  b.dataset.action = action;
  b.textContent = text;
  b.title = title;
  b.disabled = controller !== null;
  b.onclick = () => { if (!controller) onclick(); };  // no action while an answer streams, whatever calls it
  return b;
}

function editorNode(chat, i) {
  const m = chat.messages[i];
  const box = document.createElement("div");
  box.className = "editor";
  const area = document.createElement("textarea");
  area.value = editing.draft ?? (m.content || "");
  area.oninput = () => { editing.draft = area.value; };
  area.rows = Math.min(16, Math.max(3, area.value.split("\n").length + 1));
  const saveLabel = m.role === "user" ? "Save and send" : "Save";
  const done = () => {
    if (controller) return;  // never while an answer streams (generate() closes the editor; this is a stale one)
    editing = null;
    m.content = area.value;
    if (i === 0 && m.role === "user") chat.title = m.content.slice(0, 40) || chat.title;
    if (m.role === "user") {  // the conversation goes on from the edited message: a new answer replaces what followed
      chat.messages.splice(i + 1);
      generate(chat);
    } else {
      save();
      render();
    }
  };
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); done(); }
    if (e.key === "Escape") { editing = null; render(); }
  });
  const bar = document.createElement("div");
  bar.className = "actions";
  bar.append(button("save", saveLabel, "Ctrl+Enter", done),
             button("cancel", "Cancel", "Esc", () => { editing = null; render(); }));
  box.append(area, bar);
  if (editing.fresh) {
    editing.fresh = false;
    setTimeout(() => area.focus(), 0);
  }
  return box;
}

function actionsNode(chat, i) {
  const m = chat.messages[i];
  const bar = document.createElement("div");
  bar.className = "actions";
  if (m.error) {  // a failed turn: send it again, or take it (the answer and its user message) out of the page
    bar.append(button("retry", "Retry", "Send this turn again; later messages stay", () => {
                 editing = null;
                 chat.messages.splice(i, 1);  // the new answer takes the failed one's place, later turns stay
                 generate(chat, i);
               }),
               button("remove", "Remove turn", "Delete this failed turn", () => {
                 editing = null;
                 if (i > 0 && chat.messages[i - 1].role === "user") chat.messages.splice(i - 1, 2);
                 else chat.messages.splice(i, 1);
                 save();
                 render();
               }));
    return bar;
  }
  bar.append(button("edit", "Edit", "Edit this message", () => {
    editing = { chat: chat.id, index: i, draft: null, fresh: true };
    render();
  }));
  if (m.role === "assistant") {
    bar.append(button("regenerate", "Regenerate", "Answer again from here", () => {
      editing = null;
      chat.messages.splice(i);
      generate(chat);
    }));
  }
  bar.append(button("delete", "Delete", "Delete this message", () => {
    chat.messages.splice(i, 1);
    editing = null;
    save();
    render();
  }));
  return bar;
}

function contentNode(m) {
  const c = document.createElement("div");
  c.className = "content";
  if (m.role === "assistant") {
    c.classList.add("markdown");
    try {
      c.appendChild(Markdown.render(m.content || ""));
    } catch (e) {  // a renderer bug must not hide the answer or break the page: show it as plain text
      c.classList.remove("markdown");
      c.textContent = m.content || "";
    }
  } else {
    c.textContent = m.content || "";
  }
  return c;
}

function messageNode(chat, i) {
  const m = chat.messages[i];
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  const failed = m.error || (m.role === "user" && chat.messages[i + 1] && chat.messages[i + 1].error);
  if (failed) div.classList.add("failed");
  const isStreaming = streaming !== null && streaming.answer === m;
  if (isStreaming) div.classList.add("streaming");
  if (m.reasoning) {
    const r = document.createElement("div");
    r.className = "reasoning";
    r.textContent = m.reasoning;
    div.appendChild(r);
  }
  const isEditing = editing && editing.chat === chat.id && editing.index === i;
  if (isEditing) div.appendChild(editorNode(chat, i));
  else if (m.content || isStreaming || !(m.error || m.reasoning)) div.appendChild(contentNode(m));
  if (m.stopped) {
    const s = document.createElement("div");
    s.className = "note";
    s.textContent = "stopped";
    div.appendChild(s);
  }
  if (m.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = m.error;
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = "This turn is not sent to the model with later messages.";
    div.append(e, note);
  }
  if (!isEditing && !isStreaming) div.appendChild(actionsNode(chat, i));
  return div;
}

/** Redraws the page; scrolls to the bottom, or just far enough to show message `show` when one is given. */
function render(show = null) {
  renderList();
  const box = $("messages");
  box.textContent = "";
  const chat = current();
  if (!chat) return;
  let shown = null;
  chat.messages.forEach((m, i) => {
    const node = messageNode(chat, i);
    if (streaming && streaming.answer === m) streaming.node = node;
    if (m === show) shown = node;
    box.appendChild(node);
  });
  if (shown) shown.scrollIntoView({ block: "nearest" });
  else box.scrollTop = box.scrollHeight;
}

/** Redraws the streaming answer alone (once per frame), keeping the view at the bottom if it was there. */
let redrawPending = false;
function redrawAnswer() {
  if (redrawPending) return;
  redrawPending = true;
  requestAnimationFrame(() => {
    redrawPending = false;
    if (!streaming || !streaming.node || !streaming.node.isConnected) return;
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
    const chat = current();
    const i = chat ? chat.messages.indexOf(streaming.answer) : -1;
    if (i < 0) return;
    const node = messageNode(chat, i);
    streaming.node.replaceWith(node);
    streaming.node = node;
    if (atBottom) box.scrollTop = box.scrollHeight;
  });
}

async function send(text) {
  if (!current()) newChat();
  const chat = current();
  chat.messages.push({ role: "user", content: text });
  if (chat.title === "New conversation") chat.title = text.slice(0, 40);
  await generate(chat);
}

/** Reads the SSE stream of a chat completion into `answer`; throws with the server's message on an error event. */
async function readStream(res, answer, t0) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let tFirst = 0;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") continue;
      const obj = JSON.parse(data);
      if (obj.error) throw new Error(obj.error.message || JSON.stringify(obj.error));
      const choice = (obj.choices || []).find((c) => !c.index);  // the first choice (the page asks for one)
      const delta = choice ? choice.delta : null;
      if (delta && (delta.content || delta.reasoning_content)) {
        answer.content += delta.content || "";
        answer.reasoning += delta.reasoning_content || "";
        redrawAnswer();
      }
      if (obj.timings) {
        const nTokens = obj.timings.predicted_n;
        if (!tFirst && nTokens) tFirst = performance.now();
        const sec = (performance.now() - (tFirst || t0)) / 1000;
        const rate = obj.timings.predicted_per_second || (sec > 0 && nTokens > 1 ? (nTokens - 1) / sec : 0);
        $("speed").textContent = rate.toFixed(1) + " tok/s";
      }
    }
  }
}

/** Streams an answer from the server to the messages before `at`, inserted at `at` (by default appended: a retried
 * earlier turn is answered in place, later messages stay); an error stays on that answer. */
async function generate(chat, at = chat.messages.length) {
  if (controller) return;  // one generation at a time: a second would take over `controller` and `streaming`
  const answer = { role: "assistant", content: "", reasoning: "" };
  const messages = history(chat.messages.slice(0, at));
  chat.messages.splice(at, 0, answer);
  const show = at < chat.messages.length - 1 ? answer : null;  // in place: keep the view there, not at the bottom
  editing = null;  // an open editor would commit an edit under the streaming answer
  controller = new AbortController();
  streaming = { answer, node: null };
  $("send").disabled = true;
  $("stop").disabled = false;
  save();
  render(show);
  try {
    const body = { messages, stream: true, timings_per_token: true, ...sampling() };
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal, body: JSON.stringify(body),
    });
    if (!res.ok) {
      const text = await res.text();
      let msg = "";
      try { msg = JSON.parse(text).error.message; } catch (e) { msg = text.trim().slice(0, 500); }
      throw new Error(msg || "HTTP " + res.status + " " + res.statusText);
    }
    await readStream(res, answer, performance.now());
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else answer.error = String(e.message || e);
  } finally {
    controller = null;
    streaming = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    save();
    render(show);
    refreshStats();
  }
}

async function refreshStats() {
  try {
    const res = await fetch("/rapidmoe/stats", { headers: headers() });
    if (!res.ok) return;
    const s = await res.json();
    if (s.model) $("model").textContent = s.model;
    $("split").hidden = !s.split;
    if (!s.split) return;
    $("critical-share").textContent = (100 * s.critical_fraction).toFixed(1) + " %";
    const box = $("r-hist");
    box.textContent = "";
    for (const layer of s.layers) {
      const row = document.createElement("div");
      row.className = "row";
      const label = document.createElement("span");
      label.textContent = "L" + layer.layer + " r=" + layer.mean_r.toFixed(2);
      row.appendChild(label);
      const bars = document.createElement("div");
      bars.className = "bars";
      const total = layer.counts.reduce((a, b) => a + b, 0) || 1;
      layer.counts.forEach((n, r) => {
        const bar = document.createElement("div");
        bar.className = "bar";
        bar.style.width = (100 * n / total) + "%";
        bar.style.background = "hsl(" + (220 - 200 * r / Math.max(1, s.k)) + ", 70%, 60%)";
        bar.title = "r=" + r + ": " + n + " tokens";
        bars.appendChild(bar);
      });
      row.appendChild(bars);
      box.appendChild(row);
    }
  } catch (e) { /* the page keeps working without statistics */ }
}

for (const id of SETTINGS) {
  const saved = localStorage.getItem("rapidmoe.setting." + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("rapidmoe.setting." + id, $(id).value));
}
$("new-chat").onclick = newChat;
$("stop").onclick = () => { if (controller) controller.abort(); };
$("composer").onsubmit = (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
};
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
});
render();
refreshStats();
setInterval(refreshStats, 3000);
