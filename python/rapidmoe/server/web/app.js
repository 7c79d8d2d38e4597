// RapidMoE chat page: conversations in localStorage, streaming /v1/chat/completions (SSE over fetch), stop,
// sampling settings, live tokens/s, and for a RESplit model the split-routing statistics of /rapidmoe/stats.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["temperature", "top_p", "top_k", "max_tokens", "seed", "system", "api_key"];
let state = JSON.parse(localStorage.getItem("rapidmoe.chats") || "null") || { chats: [], current: null };
let controller = null;

function save() { localStorage.setItem("rapidmoe.chats", JSON.stringify(state)); }
function current() { return state.chats.find((c) => c.id === state.current); }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function newChat() {
  const chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New conversation",
                 messages: [] };
  state.chats.unshift(chat);
  state.current = chat.id;
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
    del.title = "Delete";
    del.onclick = (e) => {
      e.stopPropagation();
      state.chats = state.chats.filter((c) => c.id !== chat.id);
      if (state.current === chat.id) state.current = state.chats.length ? state.chats[0].id : null;
      save();
      render();
    };
    li.appendChild(del);
    li.onclick = () => { state.current = chat.id; save(); render(); };
    ul.appendChild(li);
  }
}

function messageNode(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  if (m.reasoning) {
    const r = document.createElement("div");
    r.className = "reasoning";
    r.textContent = m.reasoning;
    div.appendChild(r);
  }
  const c = document.createElement("div");
  c.className = "content";
  c.textContent = m.content || "";
  div.appendChild(c);
  return div;
}

function render() {
  renderList();
  const box = $("messages");
  box.textContent = "";
  const chat = current();
  if (!chat) return;
  for (const m of chat.messages) box.appendChild(messageNode(m));
  box.scrollTop = box.scrollHeight;
}

function sampling() {
  const num = (id) => Number($(id).value);
  return { temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k"),
           max_tokens: num("max_tokens"), seed: num("seed") };
}

async function send(text) {
  if (!current()) newChat();
  const chat = current();
  chat.messages.push({ role: "user", content: text });
  if (chat.title === "New conversation") chat.title = text.slice(0, 40);
  const answer = { role: "assistant", content: "", reasoning: "" };
  chat.messages.push(answer);
  save();
  render();
  const node = $("messages").lastChild;
  const history = chat.messages.slice(0, -1).map((m) => ({ role: m.role, content: m.content }));
  const system = $("system").value.trim();
  if (system) history.unshift({ role: "system", content: system });
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let tFirst = 0, nTokens = 0;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ messages: history, stream: true, timings_per_token: true, ...sampling() }),
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || res.statusText);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
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
        if (obj.error) throw new Error(obj.error.message);
        const delta = obj.choices && obj.choices[0] ? obj.choices[0].delta : null;
        if (delta && (delta.content || delta.reasoning_content)) {
          answer.content += delta.content || "";
          answer.reasoning += delta.reasoning_content || "";
          node.replaceWith(messageNode(answer));
          render();
        }
        if (obj.timings) {
          nTokens = obj.timings.predicted_n;
          if (!tFirst && nTokens) tFirst = performance.now();
          const sec = (performance.now() - (tFirst || t0)) / 1000;
          const rate = obj.timings.predicted_per_second || (sec > 0 && nTokens > 1 ? (nTokens - 1) / sec : 0);
          $("speed").textContent = rate.toFixed(1) + " tok/s";
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") chat.messages.push({ role: "error", content: String(e.message || e) });
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    save();
    render();
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
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
render();
refreshStats();
setInterval(refreshStats, 3000);
